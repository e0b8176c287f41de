"""The job bench/checkpoint_pause.py measures: a CTR-like step on one large embedding table.

Each worker fills its share of the table's rows (ids 0 .. rows-1, by lookups of `--fill-batch`
new ids: rows are made at their first lookup), meets the others, then trains until the file
`--stop` exists (or `--max-steps`): a batch of `--batch` examples x `--fields` ids drawn
Zipf(1.1) over the filled rows, a linear head over their 16-wide rows, a logistic loss, a push.
The chief asks for checkpoint k (a RequestCheckpoint call, as a chief-role caller may; every
worker meets it after its current step) at its first step after the file `<--trigger>k` appears,
so the bench decides when checkpoints are taken. After every step it prints
"STEP <worker> <step> <unix time at its end> <seconds since the previous step's end>": the
step's wall time as the worker sees it, everything included (the lookup, the push, a
checkpoint's barrier, a wait for a restoring shard).
"""

import argparse
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

DIM = 16


def fill(ctx, embedding: nn.Module, rows: int, batch: int) -> None:
    """Look up this worker's share of ids 0 .. rows-1, `batch` at a time: each lookup makes its rows."""
    share = -(-rows // ctx.num_workers)
    start, end = ctx.worker_index * share, min(rows, (ctx.worker_index + 1) * share)
    with torch.no_grad():
        for first in range(start, end, batch):
            embedding(torch.arange(first, min(end, first + batch)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--batch", type=int, default=1024, help="examples a step")
    parser.add_argument("--fields", type=int, default=16, help="ids an example")
    parser.add_argument("--fill-batch", type=int, default=65536)
    parser.add_argument("--max-steps", type=int, default=10**9, help="steps at most")
    parser.add_argument("--stop", required=True, help="training ends once this file exists")
    parser.add_argument("--trigger", required=True, help="the chief asks for checkpoint k once <this>k exists")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    ctx = ps.init()
    torch.manual_seed(args.seed)
    embedding = ps.nn.HashEmbedding(DIM, name="pause.table", capacity=args.rows)
    head = nn.Linear(args.fields * DIM, 1)
    opt = ps.optim.Adagrad([*head.named_parameters(), ("table", embedding.placeholder)], lr=0.01)
    started = time.time()
    fill(ctx, embedding, args.rows, args.fill_batch)
    print(f"FILLED {ctx.worker_index} {time.time() - started:.2f}", flush=True)
    ctx.barrier("filled")
    rng = np.random.default_rng(args.seed * 1000 + ctx.worker_index)
    last, requested = time.time(), 0
    for step in range(1, args.max_steps + 1):
        if os.path.exists(args.stop):
            break
        if ctx.is_chief and os.path.exists(f"{args.trigger}{requested + 1}"):
            requested += 1
            ctx.coordinator.request_checkpoint()  # met after this step, by every worker
            print(f"REQUESTED {requested} {time.time():.3f}", flush=True)
        ranks = (rng.zipf(1.1, (args.batch, args.fields)) - 1) % args.rows
        labels = torch.from_numpy((rng.random(args.batch) < 0.25).astype(np.float32))
        opt.zero_grad()
        rows = embedding(torch.from_numpy(ranks)).flatten(1)
        F.binary_cross_entropy_with_logits(head(rows).squeeze(1), labels).backward()
        opt.step()
        now = time.time()
        print(f"STEP {ctx.worker_index} {step} {now:.3f} {now - last:.4f}", flush=True)
        last = now


if __name__ == "__main__":
    main()
