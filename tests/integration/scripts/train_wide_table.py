"""A CTR-like job whose one embedding table is large enough that a checkpoint takes a while to write:
the chief first fills `--rows` rows (in steps of 100k ids), then every worker trains `--steps` steps of
`--batch` uniform ids (Adagrad, a linear head). Each worker appends one JSON line per training step to
`--times`.<worker>: the wall time the step ended and how long it took, so a test can see how long
the workers were held while checkpoints were written."""

import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--rows", type=int, default=1_000_000)
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch", type=int, default=2048)
parser.add_argument("--times", required=True)
args = parser.parse_args()

ctx = ps.init()
embedding = ps.nn.HashEmbedding(16, std=0.01, name="wide")
head = nn.Linear(16, 1)
opt = ps.optim.Adagrad([*head.named_parameters(), ("wide", embedding.placeholder)], lr=0.05)


def step(ids: torch.Tensor, seed: int) -> float:
    started = time.monotonic()
    target = torch.randint(0, 2, (len(ids),), generator=torch.Generator().manual_seed(seed)).float()
    opt.zero_grad()
    F.binary_cross_entropy_with_logits(head(embedding(ids)).squeeze(1), target).backward()
    opt.step()
    return time.monotonic() - started


first = ctx.resume_step
if ctx.is_chief and first == 0:  # every row exists before training: the checkpoints write them all
    for lo in range(0, args.rows, 100_000):
        step(torch.arange(lo, min(lo + 100_000, args.rows)), lo)
    first = ctx.resume_step
with open(f"{args.times}.{ctx.worker_index}", "a", encoding="utf-8") as times:
    generator = torch.Generator().manual_seed(ctx.worker_index)
    for number in range(args.steps):
        took = step(torch.randint(0, args.rows, (args.batch,), generator=generator), number)
        times.write(json.dumps({"end": time.time(), "took": took}) + "\n")
        times.flush()
        if number % 20 == 0:
            print(f"trained step {number}", flush=True)
ctx.report_result(trained=args.steps)
