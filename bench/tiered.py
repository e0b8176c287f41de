"""Tables bigger than memory (docs/scaling.md, "Tiered tables"). Two measurements, one JSON line each:

- `table`: a TieredTable in this process (dim 16, Adagrad) under a memory budget, and the same
  steps on an in-memory EmbeddingTable back to back (`in_memory`): N rows made by lookups, then
  training steps (a lookup and a push of the distinct ids among B draws) of ranks drawn uniformly
  and with a Zipf skew (a = 1.1), each rank's id a hash of it; rows/s (distinct ids, each looked
  up and updated; the ids are drawn before the clock starts), memory bytes per row (the memory
  tier at capacity / its rows), disk bytes per row (the spill file's allocated blocks), the
  store's own memory per row on disk, the process's RssAnon and RssFile.
- `stores`: batch get/put of 8-byte keys and 136-byte values at random ids, in the tiered tables'
  store (server/spill_store.py) and, when installed, RocksDB (rocksdict, as the first tiered
  tables set it up) and LMDB; RSS of each in a process of its own.

    python bench/tiered.py table [--rows 2000000] [--budget 64MiB] [--batch 16384] [--steps 100]
    python bench/tiered.py stores [--rows 3000000]
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from paramserver.base.byte_size import parse_byte_size  # noqa: E402
from paramserver.server.embedding_table import EmbeddingTable, RowPolicy  # noqa: E402
from paramserver.server.sparse_optimizers import build_sparse_optimizer  # noqa: E402
from paramserver.server.tiers import Tiers  # noqa: E402

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.05}}


def rss_mib() -> dict:
    wanted = ("RssAnon", "RssFile")
    lines = (line.split(":") for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(value.split()[0]) >> 10 for key, value in lines if key in wanted}


def table(args) -> dict:
    spill = tempfile.mkdtemp(prefix="tiered-bench-")
    tiers = Tiers.create(args.budget, spill, 0)
    try:
        t = tiers.new_table("t", 16, build_sparse_optimizer(ADAGRAD), {"kind": "normal"}, ADAGRAD, RowPolicy())
        out: dict = {"rows": args.rows, "budget": args.budget, "memory_capacity": t.hot.capacity}
        out["create_rows_per_s"] = create(t, args.rows)
        phases = draws(args)
        for name, batches in phases.items():
            reads = t.store.reads
            out[f"{name}_rows_per_s"] = train(t, batches)
            out[f"{name}_disk_reads_per_row"] = round((t.store.reads - reads) / sum(b.shape[0] for b in batches), 3)
        out["memory_bytes_per_row"] = round(t.hot.nbytes / t.hot.capacity, 1)
        on_disk = t.describe()["disk_rows"]
        out["disk_bytes_per_row"] = round(t.store.disk_bytes() / on_disk, 1)
        out["store_memory_bytes_per_row"] = round(t.store.memory_bytes() / on_disk, 2)
        started = time.perf_counter()
        saved = sum(arrays["ids"].shape[0] for _, arrays in t.row_chunks(1 << 16))
        out["row_chunks_rows_per_s"] = round(saved / (time.perf_counter() - started))
        out["rss_mib"] = rss_mib()
    finally:
        tiers.close()
        shutil.rmtree(spill, ignore_errors=True)
    memory = EmbeddingTable("t", 16, build_sparse_optimizer(ADAGRAD), {"kind": "normal"}, ADAGRAD)
    out["in_memory"] = {"create_rows_per_s": create(memory, args.rows)}
    for name, batches in phases.items():
        out["in_memory"][f"{name}_rows_per_s"] = train(memory, batches)
        out[f"{name}_vs_in_memory"] = round(out[f"{name}_rows_per_s"] / out["in_memory"][f"{name}_rows_per_s"], 3)
    return out


def create(table, rows: int) -> int:
    started = time.perf_counter()
    for lo in range(0, rows, 1 << 16):
        table.read(np.sort(keys(np.arange(lo, min(lo + (1 << 16), rows)))))
    return round(rows / (time.perf_counter() - started))


def draws(args) -> dict[str, list[np.ndarray]]:
    """The distinct ids of each step, drawn up front (the same for both tables): ranks drawn
    uniformly or by the Zipf law, each rank's id a hash of it (hot ranks are not neighbours)."""
    rng = np.random.default_rng(0)
    return {
        "uniform": [np.unique(keys(rng.integers(0, args.rows, args.batch))) for _ in range(args.steps)],
        "zipf": [np.unique(keys((rng.zipf(1.1, args.batch) - 1) % args.rows)) for _ in range(args.steps)],
    }


def keys(ranks: np.ndarray) -> np.ndarray:
    """The id of each rank: splitmix64's finalizer (a bijection), as bench/scale.py draws them."""
    z = ranks.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))).view(np.int64)


def train(table, batches: list[np.ndarray]) -> int:
    grads = np.random.default_rng(1).standard_normal((max(b.shape[0] for b in batches), 16)).astype(np.float32)
    started = time.perf_counter()
    for ids in batches:
        table.read(ids)
        table.apply(ids, grads[: ids.shape[0]])
    return round(sum(b.shape[0] for b in batches) / (time.perf_counter() - started))


STORE_SCRIPT = r"""
import json, shutil, sys, tempfile, time
import numpy as np
kind, n = sys.argv[1], int(sys.argv[2])
batch, size = 100_000, 136
path = tempfile.mkdtemp(prefix="tiered-store-")
def rss():
    lines = (l.split(":") for l in open("/proc/self/status").read().splitlines())
    return {k: int(v.split()[0]) >> 10 for k, v in lines if k in ("RssAnon", "RssFile")}
def keys(ids):
    b = (ids.view(np.uint64) ^ np.uint64(1 << 63)).astype(">u8").tobytes()
    return [b[i:i + 8] for i in range(0, len(b), 8)]
def values(m):
    b = np.random.default_rng(m).integers(0, 255, m * size, dtype=np.uint8).tobytes()
    return [b[i:i + size] for i in range(0, len(b), size)]
if kind == "lmdb":
    import lmdb
    env = lmdb.open(path, map_size=64 << 30, sync=False, metasync=False, readahead=False, lock=False)
    def put(k, v):
        with env.begin(write=True) as txn:
            txn.cursor().putmulti(zip(k, v))
    def get(k):
        with env.begin() as txn:
            return [txn.get(x) for x in k]
elif kind == "rocksdb":  # as the first tiered tables set it up: 4 KiB blocks, bloom filters, no compression
    import rocksdict
    options = rocksdict.Options(raw_mode=True)
    options.create_if_missing(True)
    table = rocksdict.BlockBasedOptions()
    table.set_block_cache(rocksdict.Cache(64 << 20))
    table.set_bloom_filter(10, False)
    table.set_block_size(4 << 10)
    options.set_block_based_table_factory(table)
    options.set_write_buffer_size(32 << 20)
    options.set_compression_type(rocksdict.DBCompressionType.none())
    db = rocksdict.Rdict(path, options)
    write = rocksdict.WriteOptions()
    write.disable_wal = True
    def put(k, v):
        wb = rocksdict.WriteBatch(raw_mode=True)
        for a, b in zip(k, v):
            wb.put(a, b)
        db.write(wb, write)
    def get(k):
        return [x for lo in range(0, len(k), 4096) for x in db.get(k[lo:lo + 4096])]
else:  # the tiered tables' store: a record of 136 bytes is a table row of 34 float32 values
    from paramserver.server.row_record import RowRecord
    from paramserver.server.sparse_optimizers import build_sparse_optimizer
    from paramserver.server.spill_store import SpillStore
    record = RowRecord(34, build_sparse_optimizer({"name": "sgd", "hyper": {"lr": 0.1}}), False)
    store = SpillStore(path, record)
    def as_ids(k):
        return (np.frombuffer(b"".join(k), ">u8").astype(np.uint64) ^ np.uint64(1 << 63)).view(np.int64)
    def put(k, v):
        store.put(as_ids(k), np.frombuffer(b"".join(v), record.dtype))
    def get(k):
        found, records, _ = store.get(as_ids(k))
        return [b"x"] * len(k) if found.all() else [None]
rng = np.random.default_rng(0)
ids = rng.integers(-(1 << 62), 1 << 62, n, dtype=np.int64)
out = {"store": kind, "rows": n}
t = time.perf_counter()
for lo in range(0, n, batch):
    put(keys(ids[lo:lo + batch]), values(min(batch, n - lo)))
out["load_per_s"] = round(n / (time.perf_counter() - t))
t = time.perf_counter()
for _ in range(20):
    assert all(x is not None for x in get(keys(ids[rng.integers(0, n, batch)])))
out["get_per_s"] = round(20 * batch / (time.perf_counter() - t))
t = time.perf_counter()
for i in range(20):
    put(keys(ids[rng.integers(0, n, batch)]), values(batch))
out["update_per_s"] = round(20 * batch / (time.perf_counter() - t))
out["rss_mib"] = rss()
files = __import__("pathlib").Path(path).rglob("*")
out["disk_bytes_per_row"] = round(sum(p.stat().st_blocks * 512 for p in files if p.is_file()) / n, 1)
shutil.rmtree(path, ignore_errors=True)
print(json.dumps(out))
"""


def stores(args) -> list[dict]:
    results = []
    for kind in ("spill_store", "rocksdb", "lmdb"):
        module = {"rocksdb": "rocksdict", "lmdb": "lmdb"}.get(kind)
        if module and subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode:
            continue
        env = {"PYTHONPATH": str(ROOT / "src")}
        done = subprocess.run(
            [sys.executable, "-c", STORE_SCRIPT, kind, str(args.rows)], capture_output=True, text=True, env=env
        )
        failed = {"store": kind, "error": done.stderr[-500:]}
        results.append(json.loads(done.stdout) if done.returncode == 0 else failed)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["table", "stores"])
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--budget", type=parse_byte_size, default=64 << 20)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    if args.what == "table":
        args.rows = args.rows or 2_000_000
        print(json.dumps(table(args)), flush=True)
    else:
        args.rows = args.rows or 3_000_000
        for result in stores(args):
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
