"""The mistake: a torch.optim optimizer in a cluster run (--torch-worker I: only worker I uses one; -1: all)."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--torch-worker", type=int, default=-1)
args = parser.parse_args()

ctx = ps.init()
torch.manual_seed(0)
model = nn.Linear(4, 2)
mistaken = args.torch_worker in (-1, ctx.worker_index)
opt = torch.optim.SGD(model.parameters(), lr=0.1) if mistaken else ps.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    opt.zero_grad()
    F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
    opt.step()
