"""Worker script of bench/dense.py: the seed MLP on synthetic data, timed after a warm-up."""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument("--slow-worker", type=int, default=-1, help="this worker runs slower ...")
    parser.add_argument("--slow-factor", type=float, default=3.0, help="... by this factor (a sleep per step)")
    args = parser.parse_args()

    ctx = ps.init()
    torch.manual_seed(ctx.worker_index)
    x = torch.randn(16, args.batch_size, 784)
    y = torch.randint(0, 10, (16, args.batch_size))
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = ps.optim.Adam(model.parameters(), lr=1e-3, overlap=args.overlap)

    slow = ctx.worker_index == args.slow_worker

    def step(i: int) -> float:
        started = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x[i % 16]), y[i % 16])
        loss.backward()
        opt.step()
        if slow:  # a straggler: its step takes slow_factor times as long
            time.sleep((args.slow_factor - 1) * (time.perf_counter() - started))
        return loss.item()

    for i in range(args.warmup_steps):
        step(i)
    steps, dropped_before, started = 0, ctx.staleness()["dropped"], time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        loss = step(steps)
        steps += 1
        ctx.report(examples=args.batch_size, loss=loss)
    elapsed = time.perf_counter() - started
    applied = steps - (ctx.staleness()["dropped"] - dropped_before)  # a backup's late pushes train nothing
    ctx.report_result(**{f"worker{ctx.worker_index}_examples_per_s": applied * args.batch_size / elapsed})


if __name__ == "__main__":
    main()
