"""The job bench/recovery.py kills a PS under: a 1M-row embedding table and a small dense head.

Prints "STEP <n> <unix time>" after every step, so the bench sees when training goes on.
"""

import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=1_000_000)
parser.add_argument("--steps", type=int, default=400)
args = parser.parse_args()

ctx = ps.init()
embedding = ps.nn.HashEmbedding(16, name="recovery.table", capacity=args.rows)
head = nn.Linear(16, 1)
opt = ps.optim.Adagrad([*head.named_parameters(), ("table", embedding.placeholder)], lr=0.01)
if ctx.resume_step == 0:
    with torch.no_grad():  # fill the table: every id gets its row
        for start in range(0, args.rows, 65536):
            embedding(torch.arange(start, min(args.rows, start + 65536)))
rng = np.random.default_rng(0)
for step in range(ctx.resume_step, args.steps):
    ids = torch.from_numpy(rng.integers(0, args.rows, 4096))
    opt.zero_grad()
    F.mse_loss(head(embedding(ids)).squeeze(1), torch.zeros(4096)).backward()
    opt.step()
    print(f"STEP {step + 1} {time.time():.3f}", flush=True)
    time.sleep(0.02)
