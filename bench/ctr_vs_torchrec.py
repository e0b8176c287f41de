"""examples/ctr.py against TorchRec on CPU, the same data, alternated run by run.

TorchRec's side: the same synthetic Criteo lines, parsed once before training by
paramserver.data.criteo and mapped to a vocabulary per feature (26 tables, dim 16, one
per categorical feature), the same MLP (429-256-128-1) over the dense features and the
26 embeddings, batch 512 per process; tables with fbgemm's fused row-wise Adagrad in the
backward (TorchRec's usual CPU setup), the MLP with torch.optim.Adam; DistributedModelParallel
over gloo, tables sharded table-wise. TorchRec runs as its users run it ("own": torch's default threads,
every core, for one process; torchrun's OMP_NUM_THREADS=1 each for several) and, beside it, with the
torch threads and OpenMP wait policy paramserver's launcher would give a worker ("launcher split",
launch/threads.py). One TorchRec process runs against paramserver 1 PS x 1 worker, two against 2 x 2.
Ours: examples/ctr.py (Adam on the PS for the MLP and the rows).

    pip install --no-deps 'torchrec==1.8.*' 'fbgemm-gpu-cpu==1.8.*' tensordict torchmetrics==1.0.3 \\
        pyre-extensions typing-inspect pyvers          # the `torchrec` extra of pyproject.toml
    python bench/ctr_vs_torchrec.py [--pairs 3] [--topologies 1x1,2x2] [--rows 400000] [--flags=--overlap]
        [--contend 2]        # two busy processes beside every run, as other jobs on a shared machine

One JSON line per pair (examples/s of ours and of both TorchRec setups, the ratios, the load averages,
the cores each process used while it trained: bench/cpu_share.py),
then one summary line per topology. `ratio` is against TorchRec as its users run it.
"""

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from paramserver.launch import threads as launch_threads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contend import busy_processes, load  # a sibling module
from cpu_share import CpuShare  # a sibling module
from embedding import run_ctr, write_ctr_data  # a sibling benchmark script

BATCH, DIM, WARMUP = 512, 16, 5


def prepare(train: str, test: str, out: str) -> None:
    """Parse both files once and map each feature's ids to rows of its own table (unknown: the last)."""
    from paramserver.data import criteo

    def arrays(path):
        parts = list(criteo.array_batches(path, 65536))
        return [np.concatenate([p[k] for p in parts]) for k in range(3)]

    (dense, sparse, labels), (tdense, tsparse, tlabels) = arrays(train), arrays(test)
    rows, tsparse_mapped, sparse_mapped = [], np.empty_like(tsparse), np.empty_like(sparse)
    for f in range(criteo.NUM_SPARSE):
        vocab, inverse = np.unique(sparse[:, f], return_inverse=True)
        sparse_mapped[:, f] = inverse
        at = np.minimum(np.searchsorted(vocab, tsparse[:, f]), len(vocab) - 1)
        tsparse_mapped[:, f] = np.where(vocab[at] == tsparse[:, f], at, len(vocab))
        rows.append(len(vocab) + 1)
    np.savez(out, dense=dense, sparse=sparse_mapped, labels=labels, tdense=tdense, tsparse=tsparse_mapped,
             tlabels=tlabels, rows=np.array(rows))


def _rank(rank: int, world: int, data: str, port: int, result: str, threads: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv, ShardingType

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    z = np.load(data)
    rows = [int(r) for r in z["rows"]]
    names = [f"t{f}" for f in range(len(rows))]
    tables = [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[n])
              for n, r in zip(names, rows)]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
            self.mlp = nn.Sequential(nn.Linear(13 + 26 * DIM, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                                     nn.Linear(128, 1))

        def forward(self, dense, kjt):
            pooled = self.ebc(kjt).values()
            return self.mlp(torch.cat([dense, pooled], dim=1)).squeeze(1)

    torch.manual_seed(0)
    model = Model()
    sharder = EmbeddingBagCollectionSharder(  # fused into the backward: no gradient tensors for the tables
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01})
    constraints = {n: ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE.value]) for n in names}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints)
    pg = dist.GroupMember.WORLD
    plan = planner.collective_plan(model, [sharder], pg)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(pg), device=torch.device("cpu"),
                                   plan=plan, sharders=[sharder])
    dense_opt = torch.optim.Adam([p for name, p in dmp.named_parameters() if ".mlp." in f".{name}"], lr=1e-3)
    dense, sparse, labels = (torch.from_numpy(z[k][rank::world].copy()) for k in ("dense", "sparse", "labels"))
    n = (len(labels) // BATCH) * BATCH

    def kjt(ids):  # (B, 26) -> one id per feature and example
        return KeyedJaggedTensor(keys=names, values=ids.t().reshape(-1).contiguous(),
                                 lengths=torch.ones(ids.numel(), dtype=torch.int32))

    batches = [(dense[i:i + BATCH], kjt(sparse[i:i + BATCH]), labels[i:i + BATCH]) for i in range(0, n, BATCH)]
    started, done = 0.0, 0
    for step, (d, k, y) in enumerate(batches):
        if step == WARMUP:
            dist.barrier()
            started, done = time.perf_counter(), 0
        dense_opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(dmp(d, k), y)
        loss.backward()
        dense_opt.step()
        done += len(y)
    rate = done / (time.perf_counter() - started)
    dmp.eval()  # held-out AUC: each process scores its share of the test lines (the tables' shards answer all)
    tdense, tsparse, tlabels = (torch.from_numpy(z[k][rank::world].copy()) for k in ("tdense", "tsparse", "tlabels"))
    tn = (len(tlabels) // BATCH) * BATCH
    with torch.no_grad():
        scores = [torch.sigmoid(dmp(tdense[i:i + BATCH], kjt(tsparse[i:i + BATCH]))) for i in range(0, tn, BATCH)]
    mine = (rate, torch.cat(scores).tolist(), tlabels[:tn].tolist())
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        from paramserver.evaluation import roc_auc

        auc = roc_auc(np.concatenate([g[2] for g in gathered]), np.concatenate([g[1] for g in gathered]))
        with open(result, "w") as f:
            json.dump({"examples_per_s": sum(g[0] for g in gathered), "test_auc": round(float(auc), 4)}, f)
    dist.barrier()
    dist.destroy_process_group()
    # TorchRec's native threads may still be running when the interpreter tears down, which then
    # aborts ("terminate called without an active exception"): leave without the teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torchrec_threads(world: int, setup: str) -> tuple[int, dict[str, str]]:
    """(torch threads, environment) of each TorchRec process. "own": what its users run with, torch's
    default (every core this process may use) for a single process, torchrun's OMP_NUM_THREADS=1 for
    several; "launcher": what paramserver's launcher would give `world` workers (launch/threads.py)."""
    if setup == "launcher":
        choice = launch_threads.measure(world)
        return choice.torch_threads, dict(choice.env)
    return (len(os.sched_getaffinity(0)) if world == 1 else 1), {}


def torchrec_run(world: int, data: str, tmp: str, setup: str = "own") -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = f"{tmp}/torchrec.json"
    if os.path.exists(result):
        os.remove(result)
    threads, env = torchrec_threads(world, setup)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # the spawned processes start with it, before their torch starts OpenMP
    try:
        mp.spawn(_rank, args=(world, data, port, result, threads), nprocs=world, join=True)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    with open(result) as f:
        return {**json.load(f), "torch_threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="alternated pairs of runs per topology")
    parser.add_argument("--topologies", default="1x1,2x2", help="PSxWORKERS (TorchRec: WORKERS processes)")
    # TorchRec's tables exist before its timer starts and each process times itself; ours creates rows
    # as ids first come and is timed as a cluster, to its last worker's end: a short run weighs those
    parser.add_argument("--rows", type=int, default=400_000, help="training lines")
    parser.add_argument("--flags", default="", help="examples/ctr.py flags, e.g. --flags=--overlap")
    parser.add_argument("--contend", type=int, default=0, help="busy processes beside every run (bench/contend.py)")
    args = parser.parse_args()
    topologies = [tuple(int(n) for n in t.split("x")) for t in args.topologies.split(",")]
    results: dict[str, list[dict]] = {f"{p}x{w}": [] for p, w in topologies}
    with tempfile.TemporaryDirectory() as tmp:
        train, test = write_ctr_data(tmp, args.rows)
        data = f"{tmp}/torchrec.npz"
        prepare(train, test, data)
        for pair in range(args.pairs):
            for num_ps, workers in topologies:
                with busy_processes(args.contend) as busy:
                    with CpuShare(exclude=busy) as ours_cores:
                        ours = run_ctr(num_ps, workers, shlex.split(args.flags), train, test)
                    ours_load = load()
                    with CpuShare(exclude=busy) as theirs_cores:
                        theirs = torchrec_run(workers, data, tmp, "own")
                    theirs_load = load()
                    split = torchrec_run(workers, data, tmp, "launcher")
                record = {"bench": "ctr_vs_torchrec", "case": "pair", "pair": pair, "topology": f"{num_ps}x{workers}",
                          "flags": args.flags, "contend": args.contend,
                          "paramserver_examples_per_s": ours["examples_per_s"], "paramserver_load": ours_load,
                          "paramserver_torch_threads": ours["torch_threads"],
                          "paramserver_test_auc": ours["test_auc"], "torchrec_processes": workers,
                          "torchrec_examples_per_s": round(theirs["examples_per_s"], 1),
                          "torchrec_test_auc": theirs["test_auc"], "torchrec_torch_threads": theirs["torch_threads"],
                          "torchrec_load": theirs_load, "paramserver_cores": ours_cores.cores(),
                          "torchrec_cores": theirs_cores.cores(),
                          "ratio": round(ours["examples_per_s"] / theirs["examples_per_s"], 3),
                          "torchrec_launcher_split_examples_per_s": round(split["examples_per_s"], 1),
                          "torchrec_launcher_split_torch_threads": split["torch_threads"],
                          "ratio_to_launcher_split": round(ours["examples_per_s"] / split["examples_per_s"], 3)}
                results[record["topology"]].append(record)
                print(json.dumps(record), flush=True)
    for topology, pairs in results.items():
        ratios, split = [p["ratio"] for p in pairs], [p["ratio_to_launcher_split"] for p in pairs]
        print(json.dumps({"bench": "ctr_vs_torchrec", "case": "summary", "topology": topology, "pairs": len(pairs),
                          "ratio_median": round(statistics.median(ratios), 3), "ratio_min": min(ratios),
                          "ratio_max": max(ratios),
                          "ratio_to_launcher_split_median": round(statistics.median(split), 3)}), flush=True)


if __name__ == "__main__":
    main()
