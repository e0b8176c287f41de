"""A torch DataLoader with worker processes inside a paramserver worker (fork or spawn).

Each worker trains on a Dataset of --samples indexed samples for --epochs epochs through
`DataLoader(num_workers=--loader-workers, multiprocessing_context=--context)`; the loader's
processes are started again every epoch (no persistent_workers), so an epoch is a fork (or
spawn) while the worker's gRPC and heartbeat threads run. Every sample carries its index; the
worker counts the indices it trained on and writes them, with the pids of the loader processes
that made each epoch's batches and the start method they used, to OUT_DIR/worker<i>.json at
the end.

The `if __name__ == "__main__":` guard is what torch documents for spawn: a spawned loader
process imports this file again (as __mp_main__), and the guard keeps it from training.
"""

import argparse
import collections
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import paramserver as ps


class Indexed(Dataset):
    """Sample i: (i, x_i, y_i), x_i and y_i computed from i alone; made in a loader process."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return i, os.getpid(), torch.randn(8, generator=g), i % 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--loader-workers", type=int, default=2)
    parser.add_argument("--context", default=os.environ.get("DATALOADER_CONTEXT", "fork"),
                        help="fork (torch's default on Linux) or spawn")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()

    ctx = ps.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = ps.optim.SGD(model.named_parameters(), lr=0.01)
    loader = DataLoader(Indexed(args.samples), batch_size=args.batch, shuffle=True,
                        num_workers=args.loader_workers, multiprocessing_context=args.context)
    seen: collections.Counter = collections.Counter()
    loader_pids: list[list[int]] = []  # per epoch: the loader processes that made its batches
    steps = 0
    for _ in range(args.epochs):
        pids: set[int] = set()
        for index, pid, x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            ctx.report(examples=len(index), loss=loss.item())
            seen.update(index.tolist())
            pids.update(pid.tolist())
            steps += 1
        loader_pids.append(sorted(pids))
    opt.pull()
    record = {"worker": ctx.worker_index, "pid": os.getpid(), "steps": steps,
              "start_method": loader.multiprocessing_context.get_start_method(),
              "seen": {str(i): n for i, n in sorted(seen.items())}, "loader_pids": loader_pids}
    with open(os.path.join(args.out_dir, f"worker{ctx.worker_index}.json"), "w") as out:
        json.dump(record, out)
    print(f"worker {ctx.worker_index} done: {steps} steps, {sum(seen.values())} samples", flush=True)


if __name__ == "__main__":
    main()
