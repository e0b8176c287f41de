"""A PS's throughput against the cores it is given: rows/s of a CTR-like training step.

One process holds one shard (server/shard.py: a Shard over a TableStore, the PS's request path
below the wire), filled once. For each core set of `--cores` (e.g. "0 0,1" here, "0 0-7 0-15" on
a 16-core machine) it pins itself to those cores (sched_setaffinity, as `taskset -c`) and runs
`--threads` request threads per core, each calling `Shard.step` in a loop as the PS's gRPC
threads do once a request is decoded: every step pushes Adagrad gradients for a batch of distinct
ids of every table (async mode, applied on arrival) and looks up the rows of another batch. The
tables (`--tables` of dim `--dim`, `--rows` rows each, every row created first) are those of a
Criteo-like model; ids are Zipf-distributed, distinct within a batch (`--batch` ids per table per
step). The core sets take turns, `--rounds` windows each, so that a busy spell of a shared
machine does not fall on one set alone; the best window of each counts (the median is given too).

The load generator costs nothing per step: each thread cycles through steps built before the
clock starts (ids, gradients), so the cores go to the shard alone. What it leaves out is the wire
(decoding a request, encoding the reply: the tensor stream's copies and gRPC's threads).

    python bench/ps_cores.py [--cores 0 0,1] [--threads 2] [--seconds 3] [--rounds 3] [--rows 200000]

One JSON line: rows/s (ids looked up plus ids updated) for each core set, the cores the process
kept busy (CPU seconds per second), the rows per CPU-second, and each set's speedup over the first.

Several PS processes instead of threads: run one copy per core at once (`--cores 0 --threads 1`,
`--cores 1 --threads 1`, ...) and add their rows/s, against one copy alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import numpy as np

SEED = 7


def parse_cores(text: str) -> list[int]:
    """A taskset-style core list ("0", "0,1", "0-7,16-23") as core numbers."""
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def zipf_batch(rng: np.random.Generator, rows: int, batch: int) -> np.ndarray:
    """`batch` distinct ids of a Zipf(1.1) draw over `rows` ids (a CTR batch after the worker's dedup)."""
    drawn = np.unique(rng.zipf(1.1, 4 * batch) % rows)
    if drawn.shape[0] < batch:  # the head of the distribution repeats: top up with uniform ids
        extra = np.setdiff1d(rng.choice(rows, 2 * batch, replace=False), drawn)
        drawn = np.concatenate([drawn, extra[: batch - drawn.shape[0]]])
    return rng.permutation(drawn[:batch]).astype(np.int64)


def build_shard(tables: int, dim: int, rows: int):
    from paramserver.server.shard import Shard

    shard = Shard(0)
    optimizer = {"name": "adagrad", "hyper": {"lr": 0.05}}
    for t in range(tables):
        shard.tables.register(f"t{t}", dim, optimizer, {"kind": "normal", "std": 0.01})
        for lo in range(0, rows, 1 << 16):  # every row created up front: a trained model's steady state
            shard.tables.lookup(f"t{t}", np.arange(lo, min(rows, lo + (1 << 16)), dtype=np.int64))
        index, some = shard.tables.table(f"t{t}").index, np.arange(1 << 16, dtype=np.int64)
        while index.growing:  # each find moves a share of a growth under way: finish it before the clock
            index.find(some)
    return shard


def build_steps(args, count: int, seed: int):
    from paramserver.server.shard import Step

    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(count):
        pushes, lookups = [], []
        for t in range(args.tables):
            ids = zipf_batch(rng, args.rows, args.batch)
            grads = rng.standard_normal((ids.shape[0], args.dim), dtype=np.float32) * np.float32(0.01)
            pushes.append((f"t{t}", ids, grads))
            lookups.append((f"t{t}", zipf_batch(rng, args.rows, args.batch)))
        steps.append(Step(grads={}, pull=[], row_pushes=pushes, lookups=lookups))
    return steps


def window(shard, plans: list, cores: list[int], seconds: float, warmup: float) -> dict:
    """Pin this process's threads to `cores` and run one request thread per plan for `seconds`."""
    os.sched_setaffinity(0, cores)  # the calling thread; the request threads started below inherit it
    rows_per_step = sum(ids.shape[0] for _, ids, _ in plans[0][0].row_pushes) + sum(
        ids.shape[0] for _, ids in plans[0][0].lookups
    )
    done = [0] * len(plans)
    stop, measuring = threading.Event(), threading.Event()

    def serve(number: int) -> None:
        plan, i = plans[number], 0
        while not stop.is_set():
            shard.step(plan[i % len(plan)], lambda outcome, values, rows: None)
            i += 1
            if measuring.is_set():
                done[number] += 1

    workers = [threading.Thread(target=serve, args=(i,), name=f"request-{i}", daemon=True) for i in range(len(plans))]
    for worker in workers:
        worker.start()
    time.sleep(warmup)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    measuring.set()
    time.sleep(seconds)
    measuring.clear()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    steps = sum(done)
    stop.set()
    for worker in workers:
        worker.join(60)
    return {"rows_per_s": steps * rows_per_step / wall, "cpu_per_wall": cpu / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cores", nargs="+", default=["0", "0,1"], help="core sets, taskset-style, first = baseline")
    parser.add_argument("--threads", type=int, default=2, help="request threads per core")
    parser.add_argument("--seconds", type=float, default=3.0, help="measured time per window")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rows", type=int, default=200_000, help="rows per table")
    parser.add_argument("--batch", type=int, default=2048, help="distinct ids per table per step")
    parser.add_argument("--steps-per-thread", type=int, default=4, help="prebuilt steps each thread cycles through")
    parser.add_argument("--rounds", type=int, default=3, help="measured windows per core set, alternated")
    args = parser.parse_args()
    sets = [parse_cores(cores) for cores in args.cores]
    missing = sorted(set().union(*map(set, sets)) - os.sched_getaffinity(0))
    if missing:
        parser.error(f"cores {missing} are not available to this process ({sorted(os.sched_getaffinity(0))})")
    shard = build_shard(args.tables, args.dim, args.rows)
    threads = [args.threads * len(cores) for cores in sets]
    plans = [build_steps(args, args.steps_per_thread, SEED + i) for i in range(max(threads))]
    seen: list[list[dict]] = [[] for _ in sets]
    for _ in range(args.rounds):  # alternated, so that a busy spell of the machine hits every set
        for number, cores in enumerate(sets):
            seen[number].append(window(shard, plans[: threads[number]], cores, args.seconds, args.warmup))
    runs = []
    for text, count, windows in zip(args.cores, threads, seen, strict=True):
        best = max(windows, key=lambda w: w["rows_per_s"])
        runs.append(
            {
                "cores": text,
                "threads": count,
                "rows_per_s": round(best["rows_per_s"]),
                "rows_per_s_median": round(statistics.median(w["rows_per_s"] for w in windows)),
                "cpu_per_wall": round(best["cpu_per_wall"], 2),  # cores the process kept busy
                "rows_per_cpu_s": round(best["rows_per_s"] / best["cpu_per_wall"]),  # work per core-second
            }
        )
    for run in runs:
        run["speedup"] = round(run["rows_per_s"] / runs[0]["rows_per_s"], 2)
        run["speedup_median"] = round(run["rows_per_s_median"] / runs[0]["rows_per_s_median"], 2)
    print(
        json.dumps(
            {
                "bench": "ps_cores",
                "tables": args.tables,
                "dim": args.dim,
                "rows_per_table": args.rows,
                "batch": args.batch,
                "optimizer": "adagrad",
                "seconds": args.seconds,
                "rounds": args.rounds,
                "machine_cores": os.cpu_count(),
                "runs": runs,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
