"""Embedding tables: per-shard throughput, memory per row, and the CTR example's throughput.

One JSON line per case:
- shard_throughput: lookups and row-wise Adagrad updates (dim 16, Zipf ids, batches of 65,536
  ids) through one real PS process, next to the same work on a torch tensor in one process
  (the in-process limit) and on paramserver's table in one process;
- memory: bytes per stored row (dim 16, Adagrad state) from the RSS growth of a process holding
  `--rows` rows, against the row's own bytes (values + state + 8-byte key);
- ctr: examples/ctr.py (batch 512) on (1 PS, 1 worker) and (2 PS, 2 workers), examples/s and peak RSS,
  as it is (the next batch's rows come back with each step), with `--no-prefetch-rows` (a lookup
  at each forward), with `--overlap` (a step does not wait for its reply: parameters one
  update staler), and with `--overlap --prefetch 8` (parsing in a loader process).

    python bench/embedding.py [--rows 10000000] [--ctr-rows 200000] [--skip-memory] [--skip-ctr]
"""

import argparse
import io
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from paramserver.base.config import Options
from paramserver.client.ps_client import PSClient
from paramserver.client.table_client import TableClient
from paramserver.launch.local.supervisor import LocalCluster, default_torch_threads
from paramserver.tables.embedding_table import EmbeddingTable
from paramserver.tables.sparse_optimizers import build_sparse_optimizer
from paramserver.transport.grpc_transport import GrpcChannel

ROOT = Path(__file__).resolve().parents[1]
DIM, BATCH, SPACE = 16, 65536, 1_000_000
ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.01}}


def step_rows(client, tables, ids, grads):
    """One step that pushes only row gradients (how a worker's optimizer sends them)."""
    riders = tables.riders()
    riders.push("t", ids, grads)
    client.push_pull({}, [], riders=riders).wait(60)


def zipf_batches(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.unique(np.minimum(rng.zipf(1.1, BATCH), SPACE) - 1).astype(np.int64) for _ in range(count)]


def rate(fn, batches: list[np.ndarray]) -> float:
    fn(batches[0])  # warm-up
    started = time.perf_counter()
    for ids in batches[1:]:
        fn(ids)
    return sum(b.shape[0] for b in batches[1:]) / (time.perf_counter() - started)


def shard_throughput(count: int) -> dict:
    batches = zipf_batches(count)
    grads = np.random.default_rng(1).standard_normal((BATCH, DIM)).astype(np.float32)
    weight, acc = torch.zeros(SPACE, DIM), torch.zeros(SPACE, DIM)

    def torch_lookup(ids):
        return weight[torch.from_numpy(ids)]

    def torch_update(ids):
        index, g = torch.from_numpy(ids), torch.from_numpy(grads[: ids.shape[0]])
        s = acc[index] + g * g
        acc[index] = s
        weight[index] -= 0.01 * g / (s.sqrt() + 1e-10)

    table = EmbeddingTable("t", DIM, build_sparse_optimizer(ADAGRAD), {"kind": "normal", "std": 0.01}, ADAGRAD)
    proc = subprocess.Popen([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "node", "--role", "ps",
                             "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        channel = GrpcChannel(proc.stdout.readline().split()[-1], 1 << 30)
        channel.wait_ready(30)
        tables, client = TableClient([channel], 60), PSClient([channel], 60)
        tables.register("t", DIM, ADAGRAD, {"kind": "normal", "std": 0.01})
        for ids in batches:  # make the rows first, as training does
            tables.lookup("t", ids)
            table.read(ids)
        result = {
            "torch_lookup_rows_per_s": rate(torch_lookup, batches), "torch_update_rows_per_s": rate(torch_update, batches),
            "table_lookup_rows_per_s": rate(table.read, batches),
            "table_update_rows_per_s": rate(lambda ids: table.apply(ids, grads[: ids.shape[0]]), batches),
            "ps_lookup_rows_per_s": rate(lambda ids: tables.lookup("t", ids), batches),
            "ps_update_rows_per_s": rate(lambda ids: step_rows(client, tables, ids, grads[: ids.shape[0]]), batches)}
        channel.close()
    finally:
        proc.terminate()
        proc.wait(10)
    result = {k: round(v) for k, v in result.items()}
    result["ps_vs_torch_lookup"] = round(result["ps_lookup_rows_per_s"] / result["torch_lookup_rows_per_s"], 3)
    result["ps_vs_torch_update"] = round(result["ps_update_rows_per_s"] / result["torch_update_rows_per_s"], 3)
    return {"bench": "embedding", "case": "shard_throughput", "dim": DIM, "batch_ids": BATCH, **result}


MEMORY_PROBE = """
import sys, psutil, numpy as np
from paramserver.tables.embedding_table import EmbeddingTable
from paramserver.tables.sparse_optimizers import build_sparse_optimizer
spec = {"name": "adagrad", "hyper": {"lr": 0.01}}
rows = int(sys.argv[1])
before = psutil.Process().memory_info().rss
table = EmbeddingTable("t", 16, build_sparse_optimizer(spec), {"kind": "zeros"}, spec)
for start in range(0, rows, 1 << 20):
    table.read(np.arange(start, min(rows, start + (1 << 20)), dtype=np.int64) * 7919)
print((psutil.Process().memory_info().rss - before) / rows)
"""


def memory(rows: int) -> dict:
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(rows)], capture_output=True, text=True, check=True)
    per_row = float(out.stdout.strip())
    own = DIM * 4 * 2 + 8
    return {"bench": "embedding", "case": "memory", "rows": rows, "bytes_per_row": round(per_row, 1),
            "own_bytes_per_row": own, "ratio": round(per_row / own, 3)}


def write_ctr_data(directory: str, rows: int) -> tuple[str, str]:
    """Synthetic Criteo lines (examples/ctr_data.py): `rows` to train on and a tenth to test; their paths."""
    paths = []
    for name, count, seed in (("train", rows, 1), ("test", max(rows // 10, 1000), 2)):
        paths.append(f"{directory}/{name}.tsv")
        subprocess.run([sys.executable, str(ROOT / "examples" / "ctr_data.py"), "--rows", str(count), "--seed",
                        str(seed), "--out", paths[-1]], check=True)
    return paths[0], paths[1]


def run_ctr(num_ps: int, workers: int, flags: list[str], train: str, test: str, script: str = "",
            options: dict | None = None) -> dict:
    """examples/ctr.py (or `script`, taking its flags) on a local cluster (torch threads as
    `paramserver run` gives them, and `options`); its JSON record."""
    cluster = LocalCluster(num_ps, workers, script or str(ROOT / "examples" / "ctr.py"),
                           ["--train", train, "--test", test, *flags],
                           Options(torch_threads=default_torch_threads(workers), **(options or {})), out=io.StringIO(),
                           progress_every=0, log_level="WARNING")
    if cluster.run() != 0:
        raise SystemExit(cluster._lines.out.getvalue()[-3000:])
    summary = cluster.summary()
    return {"bench": "embedding", "case": "ctr", "ps": num_ps, "workers": workers, "batch_size": 512,
            "flags": " ".join(flags), "torch_threads": cluster.options.torch_threads,
            "examples_per_s": summary["examples_per_s"], "test_auc": summary["test_auc"],
            "peak_rss_mb": summary["peak_rss_mb"]}


def ctr(rows: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        train, test = write_ctr_data(tmp, rows)
        return [run_ctr(num_ps, workers, flags, train, test)
                for (num_ps, workers), flags in itertools.product(((1, 1), (2, 2)),
                                                                  ([], ["--no-prefetch-rows"], ["--overlap"],
                                                                   ["--overlap", "--prefetch", "8"]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20, help="batches per throughput measurement")
    parser.add_argument("--rows", type=int, default=10_000_000, help="rows for the memory case")
    parser.add_argument("--ctr-rows", type=int, default=200_000, help="training lines for the ctr case")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-ctr", action="store_true")
    args = parser.parse_args()
    print(json.dumps(shard_throughput(args.batches)), flush=True)
    if not args.skip_memory:
        print(json.dumps(memory(args.rows)), flush=True)
    if not args.skip_ctr:
        for record in ctr(args.ctr_rows):
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
