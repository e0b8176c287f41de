"""The job bench/elastic.py measures: a small linear model trained on data the coordinator hands out,
each step followed by a fixed wait, so that the worker count, not the machine's cores, sets the speed.

The data is `--examples` examples (features computed from each example's number) cut into
`--splits` splits (paramserver.Splits), read for `--epochs` passes: far more than a bench trains.
A step: the batch's loss (mean squared error against a fixed linear target), its gradient pushed
(SGD), then `--pace` seconds of sleep (the part of a real step a worker spends elsewhere: reading,
parsing, a model far larger than this one). It prints "IMPORTED <unix time>" once its imports are
done (before it joins the run), and after every step "STEP <worker> <examples in the step> <unix
time at its end>". Training ends once the file `--stop` exists (the bench's end), at the end of
the data, or when the launcher asks this worker to leave (SIGTERM: the library leaves at the step
boundary).
"""

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

FEATURES = 16


def features_of(examples: torch.Tensor) -> torch.Tensor:
    """Each example's features, a function of its number alone (no data to read)."""
    frequencies = torch.arange(1, FEATURES + 1, dtype=torch.float32) * 1e-3
    return torch.sin(examples.to(torch.float32).unsqueeze(1) * frequencies)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=10_000_000)
    parser.add_argument("--splits", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64, help="examples a step")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--pace", type=float, default=0.04, help="seconds of sleep each step")
    parser.add_argument("--stop", required=True, help="training ends once this file exists")
    args = parser.parse_args()

    print(f"IMPORTED {time.time():.3f}", flush=True)  # torch and paramserver: a join's start-up, before init
    ctx = ps.init()
    torch.manual_seed(1)
    model = nn.Linear(FEATURES, 1)
    target = torch.linspace(-1.0, 1.0, FEATURES)
    opt = ps.optim.SGD(list(model.named_parameters()), lr=0.05)

    def batches_of_range(start: int, stop: int, epoch: int):
        for first in range(start, stop, args.batch):
            yield torch.arange(first, min(first + args.batch, stop))

    data = ps.Splits.ranges(args.examples, args.splits, batches_of_range, batch_size=args.batch)
    for examples in ctx.resumable(data, epochs=args.epochs):
        if os.path.exists(args.stop):
            break
        x = features_of(examples)
        opt.zero_grad()
        loss = F.mse_loss(model(x).squeeze(1), x @ target)
        loss.backward()
        opt.step()
        ctx.report(examples=len(examples), loss=loss.item())
        time.sleep(args.pace)
        print(f"STEP {ctx.worker_index} {len(examples)} {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
