"""A job whose worker 1, once it trained and reported done, blocks until it is killed.

Worker 1 reports done (ctx.progress.done()), leaves the cluster (ctx.shutdown()), prints
"worker 1 finished; pid P; blocking" and then never returns, as a worker stuck in its teardown
would. --steps N: steps per worker.
"""

import argparse
import os
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

ctx = ps.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 2))
opt = ps.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(ctx.worker_index)
for step in range(args.steps):
    x, y = torch.randn(8, 20, generator=g), torch.randint(0, 2, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    ctx.report(examples=8)
print(f"worker {ctx.worker_index} trained {args.steps} steps", flush=True)
if ctx.worker_index == 1:
    ctx.progress.done()
    ctx.shutdown()
    print(f"worker 1 finished; pid {os.getpid()}; blocking", flush=True)
    threading.Event().wait()  # until killed
