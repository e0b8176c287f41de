"""Every batch leaves a mark, in an elastic run: worker w's batch b pushes -1 at cell [w, b] of a PS
variable of `max_workers` rows (SGD, lr 1), so that the final values show which batches were applied,
and how often (async and ssp: an applied batch adds exactly 1).

Each worker prints "batch W B T" once its step for batch B returned (the push applied; T: time.time()),
and trains until --stop FILE exists (at most --batches batches), --pace S seconds a batch. Then every
worker meets at a barrier and the chief writes the cells to --out (JSON). --linger S: a worker asked to
leave takes S seconds more to go (as one whose data loader closes slowly).
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn

import paramserver as ps
from paramserver.worker.recovery import preemption

parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, default=2000)
parser.add_argument("--pace", type=float, default=0.02)
parser.add_argument("--stop", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--linger", type=float, default=0.0)
args = parser.parse_args()

ctx = ps.init()
cells = nn.Parameter(torch.zeros(ctx.num_workers, args.batches))
opt = ps.optim.SGD([("cells", cells)], lr=1.0)
print(f"worker {ctx.worker_index} of {ctx.num_workers} slots starts", flush=True)
for batch in range(args.batches):
    if os.path.exists(args.stop):
        break
    opt.zero_grad()
    cells.grad = torch.zeros_like(cells)
    cells.grad[ctx.worker_index, batch] = -1.0
    try:
        opt.step()
    except preemption.Left:
        time.sleep(args.linger)
        raise
    print(f"batch {ctx.worker_index} {batch} {time.time():.3f}", flush=True)
    ctx.report(examples=1)
    time.sleep(args.pace)
ctx.barrier("trained")
if ctx.is_chief:
    opt.pull()
    with open(args.out, "w") as out:
        json.dump(cells.detach().tolist(), out)
print(f"worker {ctx.worker_index} done", flush=True)
