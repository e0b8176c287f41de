"""A small job for the TensorBoard test: Trainer.fit on a dense layer over a hash-embedding table.

Every step's loss is printed as ``loss <step> <value>`` (the value Trainer.fit reports), and
``rows <step> <count>``: the distinct ids the step pushed rows for. After training the script
logs a scalar of its own, ``eval/score`` (``ps.log_scalar``), at step 1000.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import paramserver as ps

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
args = parser.parse_args()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = ps.nn.HashEmbedding(4, name="ids")
        self.out = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embedding(ids).sum(dim=1))


ctx = ps.init()
torch.manual_seed(0)
model = Model()
opt = ps.optim.SGD(model.named_parameters(), lr=0.1)
g = torch.Generator().manual_seed(ctx.worker_index)
batches = [(torch.randint(0, 40, (8, 3), generator=g), torch.randint(0, 2, (8,), generator=g))
           for _ in range(args.steps)]
step = 0


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    global step
    step += 1
    loss = F.cross_entropy(out, y)
    if ctx.is_chief:
        print(f"loss {step} {loss.item()!r}", flush=True)
        print(f"rows {step} {len(batches[step - 1][0].unique())}", flush=True)
    return loss


ps.Trainer(model, opt, loss_fn, verbose=False).fit(batches)
ps.log_scalar("eval/score", 0.75, step=1000)
print(f"worker {ctx.worker_index} done", flush=True)
