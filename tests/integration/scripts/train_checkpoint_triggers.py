"""Workers that step at seeded random speeds while checkpoints are asked for at random moments:
by the chief's step count and clock (`--checkpoint-every`, `--checkpoint-every-seconds`), and
with `--bursts N` by N bursts of RequestCheckpoint calls from a thread of worker 1. Every
checkpoint, whatever asked for it, must be one barrier that every worker meets.

--steps N: steps per worker. --seed S: the timings (each worker draws its own from S).
Reports the steps it trained and the checkpoints the coordinator announced.
"""

import argparse
import random
import threading
import time

import torch
import torch.nn as nn

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=120)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--bursts", type=int, default=0)
args = parser.parse_args()

ctx = ps.init()
rng = random.Random(args.seed * 1000 + ctx.worker_index)


def bursts(count: int, seed: int) -> None:
    """Bursts of 2-8 requests at random moments (on the coordinator client's channel, as worker 1)."""
    burst_rng = random.Random(seed)
    for _ in range(count):
        time.sleep(burst_rng.uniform(0.2, 0.8))
        for _ in range(burst_rng.randint(2, 8)):
            ctx.coordinator.request_checkpoint()


if args.bursts and ctx.worker_index == 1:
    threading.Thread(target=bursts, args=(args.bursts, args.seed), name="checkpoint-bursts", daemon=True).start()
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = ps.optim.SGD(model.parameters(), lr=0.01)
# the chief steps slowly (50 of its steps outlast the 1 s clock), the others fast (they reach their 50th
# step long before it): where workers decided their own pauses, they waited at different barriers
pace = rng.uniform(0.025, 0.04) if ctx.worker_index == 0 else rng.uniform(0.002, 0.008)
for step in range(ctx.resume_step, args.steps):
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    time.sleep(pace if rng.random() < 0.9 else rng.uniform(0.0, 0.1))
ctx.report_result(steps=args.steps, checkpoints_announced=ctx.cluster_view().get("checkpoints_requested", 0))
