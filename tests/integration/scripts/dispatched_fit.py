"""Trainer.fit over data the coordinator hands out (a paramserver.Splits loader), with a counting model:
the model's output for a batch is its examples' cells, and the loss is minus their sum, so each
step of SGD (lr 1) adds 1 to the cell of each example it trained.

Each worker prints "history <json>": fit's per-epoch metrics as [[epoch, steps, examples, loss], ...];
--out FILE: the chief writes the final cells there (JSON) once every worker is done.
"""

import argparse
import json
import time

import torch
import torch.nn as nn

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--examples", type=int, default=240)
parser.add_argument("--splits", type=int, default=6)
parser.add_argument("--batch", type=int, default=10)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--pace", type=float, default=0.01)
parser.add_argument("--out", required=True)
args = parser.parse_args()


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.cells = nn.Parameter(torch.zeros(args.examples))

    def forward(self, ids):
        time.sleep(args.pace)
        return self.cells[ids]


def batches_of_range(start: int, stop: int, epoch: int):
    for begin in range(start, stop, args.batch):
        ids = torch.arange(begin, min(begin + args.batch, stop))
        yield ids, torch.zeros(len(ids))


ctx = ps.init()
model = Counting()
opt = ps.optim.SGD(model.named_parameters(), lr=1.0)
data = ps.Splits.ranges(args.examples, args.splits, batches_of_range, batch_size=args.batch)
history = ps.Trainer(model, opt, lambda out, y: -out.sum(), verbose=False).fit(data, epochs=args.epochs)
print("history " + json.dumps([[m.epoch, m.steps, m.examples, m.loss] for m in history]), flush=True)
ctx.barrier("trained")
if ctx.is_chief:
    opt.pull()
    with open(args.out, "w") as out:
        json.dump(model.cells.detach().tolist(), out)
