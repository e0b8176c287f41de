"""Trains --steps steps, prints TRAINED, then keeps its node up until a line arrives on stdin
(so that a test can read the node's health and metrics while it is in the cluster)."""

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
args = parser.parse_args()

ctx = ps.init()
model = nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 2))
opt = ps.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(ctx.worker_index)
for _ in range(args.steps):
    x, y = torch.randn(8, 20, generator=g), torch.randint(0, 2, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    ctx.report(examples=8)
print("TRAINED", flush=True)
sys.stdin.readline()
