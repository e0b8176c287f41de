"""Two async workers at different speeds (worker i sleeps (i + 1) x 10 ms a step); each reports
the step it resumed at, to check that a checkpoint keeps every worker's own position."""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
args = parser.parse_args()

ctx = ps.init()
model = nn.Linear(4, 1)
opt = ps.optim.SGD(model.parameters(), lr=0.01)
for step in range(ctx.resume_step, args.steps):
    opt.zero_grad()
    F.mse_loss(model(torch.ones(2, 4)).squeeze(1), torch.zeros(2)).backward()
    opt.step()
    time.sleep(0.01 * (ctx.worker_index + 1))
ctx.report_result(**{f"worker{ctx.worker_index}_resumed_at": ctx.resume_step})
