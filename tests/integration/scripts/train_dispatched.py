"""Every example leaves a mark: the data is `--examples` examples cut into `--splits` splits that the
coordinator hands out (paramserver.Splits); a batch of examples pushes -1 at each example's cell of
a PS variable (SGD, lr 1, async), so the final cells count how often each example was trained.

--pace S: seconds each batch takes (so that workers, not the two cores, set the speed). --out FILE:
the chief writes the final cells there (JSON) once every worker is done. Each worker prints
"trained E S B" per batch (epoch, split, first example), and "examples N" at its end.
"""

import argparse
import json
import time

import torch
import torch.nn as nn

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--examples", type=int, default=600)
parser.add_argument("--splits", type=int, default=12)
parser.add_argument("--batch", type=int, default=10)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--pace", type=float, default=0.02)
parser.add_argument("--out", required=True)
args = parser.parse_args()

ctx = ps.init()
cells = nn.Parameter(torch.zeros(args.examples))
opt = ps.optim.SGD([("cells", cells)], lr=1.0)


def batches_of_range(start: int, stop: int, epoch: int):
    for first in range(start, stop, args.batch):
        yield torch.arange(first, min(first + args.batch, stop))


data = ps.Splits.ranges(args.examples, args.splits, batches_of_range, batch_size=args.batch)
trained = 0
for examples in ctx.resumable(data, epochs=args.epochs):
    opt.zero_grad()
    cells.grad = torch.zeros_like(cells)
    cells.grad[examples] = -1.0
    opt.step()
    ctx.report(examples=len(examples))
    trained += len(examples)
    time.sleep(args.pace)
print(f"worker {ctx.worker_index} examples {trained}", flush=True)
ctx.barrier("trained")
if ctx.is_chief:
    opt.pull()
    with open(args.out, "w") as out:
        json.dump(cells.detach().tolist(), out)
print(f"worker {ctx.worker_index} done", flush=True)
