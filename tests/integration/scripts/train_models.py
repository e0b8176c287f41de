"""A short job of one of three models, trained `--steps` steps in this process whatever the run's
step is: "tables" (HashEmbedding tables only), "dense" (nn.Linear only) or "mixed" (both).

Its batches come through `ctx.resumable()`: batch i is drawn from seed 1000 + i, and a resumed job
skips the batches the shards counted for this worker. Reports the optimizer's step count at the
start (`started_at`) and at the end (`ended_at`), the worker's data position (`resume_step`) and
the index of the first batch it trained (`first_batch`).
"""

import argparse
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--model", choices=("tables", "dense", "mixed"), default="tables")
args = parser.parse_args()

ctx = ps.init()
torch.manual_seed(0)
tables = [ps.nn.HashEmbedding(4, std=0.1, name=f"models.table{i}") for i in range(2)]
head = nn.Linear(8, 1)
params = [] if args.model == "tables" else list(head.named_parameters())
if args.model != "dense":
    params += [(f"table{i}", table.placeholder) for i, table in enumerate(tables)]
opt = ps.optim.Adagrad(params, lr=0.05)
started, resume_step = opt.steps, ctx.resume_step
trained = []  # the index of each batch trained
for batch in itertools.islice(ctx.resumable(itertools.count(), prefetch_rows=False), args.steps):
    g = torch.Generator().manual_seed(1000 + batch)
    ids, target = torch.randint(0, 50, (16,), generator=g), torch.randn(16, generator=g)
    features = torch.cat([table(ids) for table in tables], dim=1) if args.model != "dense" else torch.randn(16, 8)
    out = head(features).squeeze(1) if args.model != "tables" else features.sum(1)
    opt.zero_grad()
    F.mse_loss(out, target).backward()
    opt.step()
    trained.append(batch)
ctx.report_result(started_at=started, ended_at=opt.steps, resume_step=resume_step, first_batch=trained[0])
