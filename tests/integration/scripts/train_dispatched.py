"""Every example leaves a mark: the data is `--examples` examples cut into `--splits` splits that the
coordinator hands out (paramserver.Splits); a batch of examples pushes -1 at each example's cell of
a PS variable (SGD, lr 1, async), so the final cells count how often each example was trained.

--pace S: seconds each batch takes (so that workers, not the two cores, set the speed). --out FILE:
the chief writes the final cells there (JSON) once every worker is done. --hold FILE with
--hold-splits K: the batches of the last K splits of the last epoch take --hold-pace seconds each
until FILE exists (so that the data lasts until a test has scaled and killed what it wanted; each
worker still steps, so a worker asked to leave leaves).

Each worker prints "read E S P" when it starts reading split S of epoch E at batch P, "trained E S P"
once batch P of that split was stepped, "examples N" and "done" at its end.
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn

import paramserver as ps
from paramserver.data.splits import range_of

parser = argparse.ArgumentParser()
parser.add_argument("--examples", type=int, default=600)
parser.add_argument("--splits", type=int, default=12)
parser.add_argument("--batch", type=int, default=10)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--pace", type=float, default=0.02)
parser.add_argument("--hold", default=None)
parser.add_argument("--hold-splits", type=int, default=0)
parser.add_argument("--hold-pace", type=float, default=0.3)
parser.add_argument("--out", required=True)
args = parser.parse_args()

ctx = ps.init()
cells = nn.Parameter(torch.zeros(args.examples))
opt = ps.optim.SGD([("cells", cells)], lr=1.0)


def split_of(example: int) -> tuple[int, int]:
    """(split, its first example) of the split holding `example`."""
    split = next(s for s in range(args.splits) if example < range_of(args.examples, args.splits, s)[1])
    return split, range_of(args.examples, args.splits, split)[0]


def batches_of_range(start: int, stop: int, epoch: int):
    split, first = split_of(start)
    print(f"read {epoch} {split} {(start - first) // args.batch}", flush=True)
    for begin in range(start, stop, args.batch):
        yield epoch, split, (begin - first) // args.batch, torch.arange(begin, min(begin + args.batch, stop))


def held(epoch: int, split: int) -> bool:
    last = epoch == args.epochs - 1 and split >= args.splits - args.hold_splits
    return last and args.hold is not None and not os.path.exists(args.hold)


data = ps.Splits.ranges(args.examples, args.splits, batches_of_range, batch_size=args.batch)
trained = 0
for epoch, split, position, examples in ctx.resumable(data, epochs=args.epochs):
    opt.zero_grad()
    cells.grad = torch.zeros_like(cells)
    cells.grad[examples] = -1.0
    opt.step()
    print(f"trained {epoch} {split} {position}", flush=True)
    ctx.report(examples=len(examples))
    trained += len(examples)
    time.sleep(args.hold_pace if held(epoch, split) else args.pace)
print(f"worker {ctx.worker_index} examples {trained}", flush=True)
ctx.barrier("trained")
if ctx.is_chief:
    opt.pull()
    with open(args.out, "w") as out:
        json.dump(cells.detach().tolist(), out)
print(f"worker {ctx.worker_index} done", flush=True)
