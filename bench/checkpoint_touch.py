"""A checkpoint's cost against the rows touched since the one before, and the touch rates of a workload.

1. Cost (a ROWS-row dim-16 Adagrad table on one PS, built in this process and written through the
   real write path, checkpoint/shard_writes.py, as bench/checkpoint_cost.py does): a whole
   checkpoint (the base) in each encoding of ``--quantize`` (bytes, seconds), then, on the float32
   one, a delta after each share of ``--shares`` of the rows was trained (one Adagrad step on that
   many distinct random rows since the checkpoint before): bytes, seconds, and their shares of the
   base's.
2. Touch rates (bench/touch_rates.py): the share of the rows that ``--steps`` steps of
   ``--workers`` x ``--batch`` examples x ``--ids`` ids touch, for the target table of
   ``--target-rows`` rows, analytic, with ids uniform, Zipf(1.1) as numpy draws them folded onto the
   rows (what the other benchmarks draw), and Zipf(1.1) cut at the table's size; checked against a
   simulation at ``--sim-rows`` rows with the draws per step scaled alike (the same draws per row),
   next to the analytic figures at that size (how the rates move with the scale).

Prints one JSON line. Files go under a temporary directory (``--dir``'s parent), deleted at the end
whatever happens. ``--skip-cost`` runs part 2 alone (seconds, under 1 GiB).

    PYTHONPATH=src python bench/checkpoint_touch.py [--rows 20000000] [--shares 0.001,0.01,0.1,0.3,0.6]
        [--quantize none,bf16,int8] [--skip-cost]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import touch_rates
from checkpoint_cost import BATCH, DIM, build, checkpoint

from paramserver.checkpoint.shard_writes import ShardWrites
from paramserver.checkpoint.store import checkpoint_name
from paramserver.server.shard import Shard

SEED = 0


def touch(tables, rows: int, share: float, rng: np.random.Generator) -> int:
    """One Adagrad step on exactly `share` of the rows (distinct, drawn at random); returns how many."""
    ids = np.sort(rng.choice(rows, int(rows * share), replace=False)).astype(np.int64)
    for lo in range(0, ids.shape[0], BATCH):
        part = ids[lo : lo + BATCH]
        grads = rng.normal(0, 0.1, (part.shape[0], DIM)).astype(np.float32)
        tables.push_checked([tables.check_push("emb", part, grads)])
    return int(ids.shape[0])


def cost(rows: int, shares: list[float], encodings: list[str], workdir: str) -> dict:
    """Bases in each encoding, then a delta after each share touched (on the float32 chain)."""
    rng = np.random.default_rng(SEED)
    started = time.perf_counter()
    tables = build(rows)
    build_s = time.perf_counter() - started
    shard = Shard(0, tables=tables)
    bases, writes = {}, None
    for encoding in encodings:
        directory = os.path.join(workdir, encoding)
        here = ShardWrites(directory, encoding)
        size, took, _ = checkpoint(here, shard, 1, "")
        bases[encoding] = {"bytes": size, "s": round(took, 2), "mb_per_s": round(size / took / 1e6, 1)}
        if encoding == "none":
            writes = here
        else:
            shutil.rmtree(directory, ignore_errors=True)  # its bytes are what it is for
    if writes is None:
        raise SystemExit("checkpoint_touch: the deltas need 'none' among --quantize")
    base = bases["none"]
    deltas = []
    for step, share in enumerate(shares, start=2):
        touched = touch(tables, rows, share, rng)
        size, took, _ = checkpoint(writes, shard, step, checkpoint_name(step - 1))
        deltas.append(
            {
                "touched_share": share,
                "touched_rows": touched,
                "bytes": size,
                "s": round(took, 3),
                "bytes_per_row": round(size / max(touched, 1), 1),
                "bytes_share": round(size / base["bytes"], 4),
                "time_share": round(took / base["s"], 4),
            }
        )
    del shard, tables
    gc.collect()
    return {"build_s": round(build_s, 1), "bases": bases, "deltas": deltas}


def rates(args: argparse.Namespace) -> dict:
    """Touched shares at the target's size (analytic) and at a scaled one (analytic and simulated)."""
    draws = args.workers * args.batch * args.ids
    kinds = ("uniform", "zipf", "zipf_truncated")
    target = {
        kind: [round(x, 4) for x in touch_rates.touched_share(kind, args.target_rows, draws, args.steps)]
        for kind in kinds
    }
    scaled_draws = max(1, round(draws * args.sim_rows / args.target_rows))
    sim_steps = [k for k in args.steps if k * scaled_draws <= args.sim_draws]
    check: dict = {"rows": args.sim_rows, "draws_per_step": scaled_draws, "steps": sim_steps, "seed": SEED}
    gaps = []
    for kind in ("uniform", "zipf"):
        analytic = touch_rates.touched_share(kind, args.sim_rows, scaled_draws, sim_steps)
        drawn = touch_rates.simulate(kind, args.sim_rows, scaled_draws, sim_steps, SEED)
        check[f"{kind}_analytic"] = [round(x, 4) for x in analytic]
        check[f"{kind}_simulated"] = [round(x, 4) for x in drawn]
        gaps += [abs(x - y) for x, y in zip(analytic, drawn, strict=True)]
    check["zipf_truncated_analytic"] = [
        round(x, 4) for x in touch_rates.touched_share("zipf_truncated", args.sim_rows, scaled_draws, sim_steps)
    ]
    check["max_gap"] = round(max(gaps, default=0.0), 4)
    return {
        "target": {"rows": args.target_rows, "draws_per_step": draws, "steps": args.steps, **target},
        "scaled": check,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument(
        "--shares", default="0.001,0.01,0.1,0.3,0.6", help="shares of the rows touched before each delta"
    )
    parser.add_argument("--quantize", default="none,bf16,int8", help="encodings of the bases")
    parser.add_argument("--skip-cost", action="store_true", help="the touch rates alone")
    parser.add_argument("--target-rows", type=int, default=675_000_000)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--ids", type=int, default=26, help="ids each example looks up")
    parser.add_argument("--steps", default="1,10,20,50,100,200,500,1000,2000,5000")
    parser.add_argument("--sim-rows", type=int, default=20_000_000)
    parser.add_argument("--sim-draws", type=int, default=600_000_000, help="ids the simulation draws at most")
    parser.add_argument("--dir", default=None, help="where the temporary checkpoint directory goes")
    args = parser.parse_args()
    args.steps = [int(x) for x in args.steps.split(",")]
    started = time.monotonic()
    result: dict = {"bench": "checkpoint_touch", "rows": args.rows, "dim": 16, "optimizer": "adagrad"}
    if not args.skip_cost:
        workdir = tempfile.mkdtemp(prefix="checkpoint-touch-", dir=args.dir)
        try:
            shares = [float(x) for x in args.shares.split(",")]
            result.update(cost(args.rows, shares, args.quantize.split(","), workdir))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    result["touch"] = rates(args)
    result["total_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
