"""Consistency modes: when a pushed gradient is applied, and when its pusher may go on.

- ``async``: every push is applied on arrival.
- ``sync``: the gradients of step t from all workers are averaged and applied once; a push
  returns when its step is applied. With B backup workers, step t is applied as soon as
  W - B workers pushed it; later pushes for step t are dropped and counted.
- ``ssp:K`` (stale synchronous parallel): pushes are applied on arrival, but a worker's push
  returns only when that worker is at most K steps ahead of the slowest. ``ssp:0`` is sync.

The Shard calls these under its own lock; nothing here is thread-safe on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SyncRound:
    """The gradients of one sync step gathered so far: running sums per variable, and who sent them."""

    step: int
    contributors: set[int] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=dict)
    rows: list[list] = field(default_factory=list)  # each contributor's embedding row pushes

    def add(self, worker: int, grads: dict[str, np.ndarray], sums: dict[str, np.ndarray]) -> None:
        """Add a worker's gradients into `sums` (buffers reused across rounds)."""
        self.contributors.add(worker)
        for name, grad in grads.items():
            if self.counts.get(name):
                sums[name] += grad
            else:
                if name not in sums or sums[name].shape != grad.shape:
                    sums[name] = np.empty_like(grad)
                np.copyto(sums[name], grad)
                self.counts[name] = 0
            self.counts[name] += 1

    def averages(self, sums: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each variable's mean gradient over the workers that sent one (in place in `sums`)."""
        for name, count in self.counts.items():
            if count > 1:
                sums[name] /= np.float32(count)
        return {name: sums[name] for name in self.counts}
