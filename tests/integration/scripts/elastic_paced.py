"""A job whose speed the worker count sets: a small linear model trained on data the coordinator hands
out (paramserver.Splits, far more than a test trains), each step followed by a fixed wait (the part of a
real step a worker spends elsewhere), so that a machine's few cores are not the limit.

After every step a worker prints "STEP <worker> <examples in the step> <unix time at its end>".
Training ends once the file --stop exists (then the script ends, and with the chief the run), at the
end of the data, or when the launcher asks this worker to leave (SIGTERM: it leaves at the step
boundary).
"""

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

FEATURES = 8

parser = argparse.ArgumentParser()
parser.add_argument("--pace", type=float, default=0.05, help="seconds of sleep each step")
parser.add_argument("--batch", type=int, default=32, help="examples a step")
parser.add_argument("--stop", required=True, help="training ends once this file exists")
args = parser.parse_args()

ctx = ps.init()
torch.manual_seed(1)
model = nn.Linear(FEATURES, 1)
target = torch.linspace(-1.0, 1.0, FEATURES)
opt = ps.optim.SGD(list(model.named_parameters()), lr=0.05)


def batches_of_range(start: int, stop: int, epoch: int):
    for first in range(start, stop, args.batch):
        yield torch.arange(first, min(first + args.batch, stop))


def features_of(examples: torch.Tensor) -> torch.Tensor:
    """Each example's features, a function of its number alone (no data to read)."""
    return torch.sin(examples.to(torch.float32).unsqueeze(1) * torch.arange(1, FEATURES + 1) * 1e-3)


data = ps.Splits.ranges(1_000_000, 500, batches_of_range, batch_size=args.batch)
for examples in ctx.resumable(data, epochs=2):
    if os.path.exists(args.stop):
        break
    x = features_of(examples)
    opt.zero_grad()
    F.mse_loss(model(x).squeeze(1), x @ target).backward()
    opt.step()
    ctx.report(examples=len(examples))
    time.sleep(args.pace)
    print(f"STEP {ctx.worker_index} {len(examples)} {time.time():.3f}", flush=True)
