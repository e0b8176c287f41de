"""Worker script of bench/net/run.py: the seed MLP (784-1024-512-10, Adam) on synthetic batches, timed
after a warm-up, as bench/dense_worker.py. `paramserver node` has no launcher to hand a result to, so the
figures go to stdout as one JSON line (bench/net/cluster.py reads it from the node's output)."""

import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()

    ctx = ps.init()
    torch.manual_seed(ctx.worker_index)
    x = torch.randn(16, args.batch_size, 784)
    y = torch.randint(0, 10, (16, args.batch_size))
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = ps.optim.Adam(model.parameters(), lr=1e-3)

    def step(i: int) -> float:
        opt.zero_grad()
        loss = F.cross_entropy(model(x[i % 16]), y[i % 16])
        loss.backward()
        opt.step()
        return loss.item()

    for i in range(args.warmup_steps):
        step(i)
    steps, pushed_before, started = 0, ctx.client.pushed_bytes, time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        loss = step(steps)
        steps += 1
    elapsed = time.perf_counter() - started
    record = {
        "worker": ctx.worker_index,
        "steps": steps,
        "seconds": round(elapsed, 3),
        "examples_per_s": round(steps * args.batch_size / elapsed, 1),
        "pushed_bytes_per_step": round((ctx.client.pushed_bytes - pushed_before) / max(steps, 1)),
        "loss": round(loss, 4),
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
