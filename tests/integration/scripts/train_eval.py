"""One script for every task of a job with an evaluator (as in TF): workers train a model with an
embedding table; the evaluator task evaluates the run's checkpoints on a held-out set.

--heldout FILE: torch.save'd {"ids", "x", "y"} (the evaluator's data). --marker-dir D: the
evaluator writes D/evaluated-<step> after each evaluation, and worker 0 with --wait-eval-at S
waits after step S until one exists (a test's proof that checkpoints are evaluated while training
runs; nothing in paramserver waits for an evaluator). --fail-eval: the evaluation function raises.
--fail-evaluator: the evaluator's script raises before it evaluates anything.
"""

import argparse
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=30)
parser.add_argument("--heldout", required=True)
parser.add_argument("--marker-dir", default="")
parser.add_argument("--wait-eval-at", type=int, default=-1)
parser.add_argument("--fail-eval", action="store_true")
parser.add_argument("--fail-evaluator", action="store_true")
args = parser.parse_args()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = ps.nn.HashEmbedding(4, std=0.1)
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, ids, x):
        return self.fc2(F.relu(self.fc1(torch.cat([self.emb(ids), x], dim=1))))


def evaluate(model, step):
    if args.fail_eval:
        raise RuntimeError(f"the evaluation function fails on purpose at step {step}")
    data = torch.load(args.heldout)
    logits = model(data["ids"], data["x"])
    metrics = {"loss": F.cross_entropy(logits, data["y"]).item(),
               "accuracy": (logits.argmax(1) == data["y"]).float().mean().item()}
    if args.marker_dir:
        (Path(args.marker_dir) / f"evaluated-{step}").touch()
    return metrics


ctx = ps.init()
torch.manual_seed(0)
model = Model()
if ctx.is_evaluator and args.fail_evaluator:
    raise RuntimeError("the evaluator fails on purpose")
if ctx.is_evaluator:
    ctx.evaluate(model, evaluate, poll_s=0.2)
    raise SystemExit(0)

opt = ps.optim.Adam(model.named_parameters(), lr=0.02)
g = torch.Generator().manual_seed(ctx.worker_index)
for step in range(1, args.steps + 1):
    ids, x = torch.randint(0, 40, (16,), generator=g), torch.randn(16, 8, generator=g)
    y = (x[:, 0] > 0).long() + (ids % 2 == 0).long()
    opt.zero_grad()
    F.cross_entropy(model(ids, x), y).backward()
    opt.step()
    if step == args.wait_eval_at:  # the checkpoint of this step is written: an evaluation must come
        deadline = time.monotonic() + 120
        while not any(Path(args.marker_dir).glob("evaluated-*")) and time.monotonic() < deadline:
            time.sleep(0.05)
print(f"worker {ctx.worker_index} done", flush=True)
