"""A job whose embedding table is bigger than its PS's table memory budget: most rows live in the
PS's spill store, and every step reads some of them back. Dense head with Adam, one table of ids in
[0, 20000). Reports the steps it trained and a checksum of some rows."""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--step-sleep", type=float, default=0.0)  # seconds after each step
args = parser.parse_args()

ctx = ps.init()
torch.manual_seed(0)
embedding = ps.nn.HashEmbedding(8, std=0.1, name="tiered.table")
head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 1))
opt = ps.optim.Adam([*head.named_parameters(), ("table", embedding.placeholder)], lr=0.01)
trained = 0
for step in range(ctx.resume_step, args.steps):
    g = torch.Generator().manual_seed(1000 + step)
    ids, target = torch.randint(0, 20_000, (256, 2), generator=g), torch.randn(256, generator=g)
    opt.zero_grad()
    F.mse_loss(head(embedding(ids).flatten(1)).squeeze(1), target).backward()
    opt.step()
    trained += 1
    print(f"trained step {step}", flush=True)
    if args.step_sleep:
        time.sleep(args.step_sleep)
opt.pull()
with torch.no_grad():
    rows = embedding(torch.arange(100))
ctx.report_result(trained=trained, table_checksum=round(rows.double().abs().sum().item(), 6))
