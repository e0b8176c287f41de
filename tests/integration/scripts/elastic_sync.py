"""A linear model trained in an elastic sync run, logged so that plain torch can replay it.

Worker w's k-th batch is `batch(w, k)` (deterministic); after each step it prints
"pushed W K S": its k-th batch went into sync step S (with one PS, the shard's sync step after the push
is S + 1: the step waits until it is applied, and no later step can be applied without this worker).
A worker asked to leave (SIGTERM) pushes its batch, leaves inside `opt.step()`, and prints that line
first. Workers train until --stop FILE exists (at most --batches batches), then meet at a barrier;
the chief writes the final weight and bias to --out (JSON).
"""

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps
from paramserver.worker.recovery import preemption

FEATURES = 8
LR = 0.002  # small: a step's error fades slowly, so the final weights still show the early steps


def batch(worker: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * worker + k)
    return torch.randn(16, FEATURES, generator=g), torch.randn(16, 1, generator=g)


def model() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(FEATURES, 1)


def loss_of(net: nn.Module, worker: int, k: int) -> torch.Tensor:
    x, y = batch(worker, k)
    return F.mse_loss(net(x), y)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--pace", type=float, default=0.02)
    parser.add_argument("--stop", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    ctx = ps.init()
    net = model()
    opt = ps.optim.SGD(net.named_parameters(), lr=LR)
    me = ctx.worker_index
    print(f"worker {me} starts", flush=True)
    for k in range(args.batches):
        if os.path.exists(args.stop):
            break
        opt.zero_grad()
        loss_of(net, me, k).backward()
        try:
            opt.step()
        except preemption.Left:  # pushed and applied, then left: its step counts
            print(f"pushed {me} {k} {ctx.client.record.step - 1}", flush=True)
            raise
        print(f"pushed {me} {k} {ctx.client.record.step - 1} {time.time():.3f}", flush=True)
        time.sleep(args.pace)
    ctx.barrier("trained")
    if me == 0:
        opt.pull()
        with open(args.out, "w") as out:
            json.dump({"weight": net.weight.detach().tolist(), "bias": net.bias.detach().tolist()}, out)
    print(f"worker {me} done", flush=True)
