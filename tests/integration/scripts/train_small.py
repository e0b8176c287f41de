"""A small job for launcher tests: trains a few steps, then reports a checksum of the PS's values.

--fail-worker I: worker I raises after its first step. --steps N: steps per worker (0: forever).
--step-sleep S: seconds between steps (default 0.01 when training forever, else 0).
"""

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--fail-worker", type=int, default=-1)
parser.add_argument("--step-sleep", type=float, default=None)
args = parser.parse_args()

ctx = ps.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 2))
opt = ps.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(ctx.worker_index)
step = 0
while args.steps == 0 or step < args.steps:
    x, y = torch.randn(8, 20, generator=g), torch.randint(0, 2, (8,), generator=g)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    ctx.report(examples=8, loss=loss.item())
    step += 1
    if ctx.worker_index == args.fail_worker:
        raise RuntimeError(f"worker {ctx.worker_index} fails on purpose")
    if args.step_sleep or args.steps == 0:
        time.sleep(0.01 if args.step_sleep is None else args.step_sleep)
opt.pull()
checksum = sum(p.double().sum().item() for p in model.parameters())
print(f"worker {ctx.worker_index}/{ctx.num_workers} done: checksum {checksum:.6f} "
      f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')})", flush=True)
ctx.report_result(**{f"worker{ctx.worker_index}_steps": step})
