"""A HashEmbedding + Linear model for the dense_sync tests: worker i trains its --counts[i] batches
(default --steps each) of fixed data, then saves its dense parameters (pulled from the PS in "ps"
mode) and, on worker 0, the table's rows for every id, to --out/w<i>.pt.

--frozen: the table's rows are looked up but not trained (a plain-torch reference can then use them).
--lookahead: read each batch one ahead (the data ends before the last step, as in examples/ctr.py),
then meet at a barrier.
--mid-barrier K: meet the others at barrier "mid" after K batches (at the end of the data if fewer).
--die-after N: worker 1 kills itself (SIGKILL) after its N-th batch, once per --out directory.
"""

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

IDS, FEATURES, DIM, BATCH = 20, 6, 4, 8


def batch(worker: int, step: int):
    """Worker `worker`'s batch `step` (tests/integration/test_dense_sync.py makes the same)."""
    g = torch.Generator().manual_seed(1000 * worker + step)
    return (torch.randint(0, IDS, (BATCH,), generator=g), torch.randn(BATCH, FEATURES, generator=g),
            torch.randn(BATCH, 1, generator=g))


class Net(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.Sequential(nn.Linear(DIM + FEATURES, 8), nn.ReLU(), nn.Linear(8, 1))
        self.emb = ps.nn.HashEmbedding(DIM, init="uniform", scale=0.5, name="emb")
        self.frozen = frozen

    def forward(self, ids, x):
        rows = self.emb(ids)
        return self.mlp(torch.cat([rows.detach() if self.frozen else rows, x], 1))


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--counts", default="")
parser.add_argument("--optimizer", default="SGD")
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--frozen", action="store_true")
parser.add_argument("--lookahead", action="store_true")
parser.add_argument("--mid-barrier", type=int, default=0)
parser.add_argument("--die-after", type=int, default=0)
parser.add_argument("--out", required=True)
args = parser.parse_args()

ctx = ps.init()
model = Net(args.frozen)
opt = getattr(ps.optim, args.optimizer)(model.named_parameters(), lr=args.lr)
counts = [int(c) for c in args.counts.split(",")] if args.counts else [args.steps] * ctx.num_workers
trained = 0
batches = iter(ctx.resumable([batch(ctx.worker_index, s) for s in range(counts[ctx.worker_index])]))
current = next(batches, None)
while current is not None:
    following = next(batches, None) if args.lookahead else None  # may end the data before this step
    ids, x, y = current
    opt.zero_grad()
    F.mse_loss(model(ids, x), y).backward()
    opt.step()
    trained += 1
    if trained == args.mid_barrier:
        ctx.barrier("mid")
    current = following if args.lookahead else next(batches, None)
    died = Path(args.out) / "died"
    if ctx.worker_index == 1 and opt.steps == args.die_after and not died.exists():
        died.touch()
        os.kill(os.getpid(), signal.SIGKILL)
if trained < args.mid_barrier:
    ctx.barrier("mid")
if args.lookahead:
    ctx.barrier("trained")
opt.pull()
saved = {"dense": {n: p.detach().clone() for n, p in model.mlp.named_parameters()}, "trained": trained}
if ctx.worker_index == 0:
    with torch.no_grad():
        saved["rows"] = model.emb(torch.arange(IDS)).clone()
torch.save(saved, Path(args.out) / f"w{ctx.worker_index}.pt")
ctx.report_result(**{f"worker{ctx.worker_index}_trained": trained})
