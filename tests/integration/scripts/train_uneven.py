"""Async workers with different amounts of data: worker i trains --steps + i * --extra steps of
a small named model (SGD), then reports its step count and, on the last worker, a checksum of
the PS's final values. Every worker meets the others after its first --steps steps, so the last
worker's extra steps come after every other worker's last one: nothing changes the values after
its checksum."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--extra", type=int, default=0)
args = parser.parse_args()

ctx = ps.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 1))
opt = ps.optim.SGD(model.named_parameters(), lr=0.05)
steps = args.steps + ctx.worker_index * args.extra
for step in range(ctx.resume_step, steps):
    g = torch.Generator().manual_seed(1000 * ctx.worker_index + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    if step + 1 == args.steps:
        ctx.barrier("common-steps-done")
result = {f"worker{ctx.worker_index}_steps": steps}
if ctx.worker_index == ctx.num_workers - 1:
    opt.pull()
    result["checksum"] = round(sum(p.double().sum().item() for p in model.parameters()), 6)
ctx.report_result(**result)
