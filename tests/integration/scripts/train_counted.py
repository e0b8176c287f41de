"""Every batch leaves a mark: worker w's batch b pushes -1 at cell [w, b] of a PS variable (SGD,
lr 1), so the final values show which batches were applied, and how often. In async and ssp
modes an applied batch adds exactly 1; in sync mode 1/k for a step of k workers.

--batches N: batches per worker. --pace S: seconds each batch takes (--slow-worker I takes 10x).
--skew-seed K: each worker waits a seeded 0-5 s before it joins. --out FILE: the chief writes
the final cells there (JSON) once every worker is done. Prints "at batch B" every 10 batches.
--copies K: K variables of cells, each marked by every batch (equal sizes: copy i lands on shard i),
so that each shard shows which batches it applied; the file then holds the list of K copies.
"""

import argparse
import json
import os
import random
import time

import torch
import torch.nn as nn

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, default=60)
parser.add_argument("--pace", type=float, default=0.02)
parser.add_argument("--slow-worker", type=int, default=-1)
parser.add_argument("--skew-seed", type=int, default=-1)
parser.add_argument("--out", required=True)
parser.add_argument("--copies", type=int, default=1)
args = parser.parse_args()

if args.skew_seed >= 0:  # before joining, so the index comes from TF_CONFIG as `paramserver run` sets it
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    time.sleep(random.Random(args.skew_seed * 1000 + index).uniform(0.0, 5.0))
ctx = ps.init()


class Cells(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cells = nn.Parameter(torch.zeros(ctx.num_workers, args.batches))
        for copy in range(1, args.copies):
            self.register_parameter(f"cells{copy}", nn.Parameter(torch.zeros(ctx.num_workers, args.batches)))

    def copies(self) -> list[nn.Parameter]:
        return [self.cells] + [getattr(self, f"cells{copy}") for copy in range(1, args.copies)]


model = Cells()
opt = ps.optim.SGD(model.named_parameters(), lr=1.0)
print(f"worker {ctx.worker_index} starts at batch {ctx.resume_step}", flush=True)
pace = args.pace * (10 if ctx.worker_index == args.slow_worker else 1)
for batch in ctx.resumable(range(args.batches)):
    opt.zero_grad()
    for cells in model.copies():
        cells.grad = torch.zeros_like(cells)
        cells.grad[ctx.worker_index, batch] = -1.0
    opt.step()
    ctx.report(examples=1)
    if (batch + 1) % 10 == 0:
        print(f"worker {ctx.worker_index} at batch {batch + 1}", flush=True)
    time.sleep(pace)
ctx.barrier("trained")
if ctx.is_chief:
    opt.pull()
    with open(args.out, "w") as out:
        copies = [cells.detach().tolist() for cells in model.copies()]
        json.dump(copies if args.copies > 1 else copies[0], out)
print(f"worker {ctx.worker_index} done", flush=True)
