"""A job that resumes exactly: batch k depends only on k, so a run resumed from a checkpoint
at step s and trained to step n must end where an uninterrupted run to n ends.

Dense layers with Adam, an embedding table (row-wise Adam), one worker. Reports a checksum of
the final dense values and of some embedding rows.
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--step-sleep", type=float, default=0.0)  # seconds after each step
args = parser.parse_args()

ctx = ps.init()
torch.manual_seed(0)
embedding = ps.nn.HashEmbedding(4, std=0.1, name="resume.table")
head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = ps.optim.Adam([*head.named_parameters(), ("table", embedding.placeholder)], lr=0.01)
for step in range(ctx.resume_step, args.steps):
    g = torch.Generator().manual_seed(1000 + step)
    ids, target = torch.randint(0, 50, (32, 2), generator=g), torch.randn(32, generator=g)
    opt.zero_grad()
    F.mse_loss(head(embedding(ids).flatten(1)).squeeze(1), target).backward()
    opt.step()
    if args.step_sleep:
        time.sleep(args.step_sleep)
opt.pull()
with torch.no_grad():
    rows = embedding(torch.arange(50))
dense = sum(p.double().sum().item() for p in head.parameters())
ctx.report_result(resumed_from=ctx.resume_step, dense_checksum=round(dense, 6),
                  table_checksum=round(rows.double().abs().sum().item(), 6))
