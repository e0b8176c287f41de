"""Placement of variables on shards.

Small variables go whole to the least-loaded shard (by bytes); a variable of at least
`split_bytes` is split along axis 0 into near-equal row ranges, one per shard (at most
one per row), each range going to the least-loaded shard not yet holding a part of it.
Placement is a pure function of the order and shapes of the variables, so every worker
computes the same one without talking to anyone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

DEFAULT_SPLIT_BYTES = 256 * 1024


@dataclass(frozen=True)
class Part:
    """One piece of a variable: rows [lo, hi) of axis 0 (or the whole variable) on one shard."""

    var: str
    name: str  # the name the shard stores it under
    shard: int
    lo: int
    hi: int
    whole: bool


class Placer:
    """Places variables one by one, remembering each shard's load. Not thread-safe."""

    def __init__(self, num_shards: int, split_bytes: int = DEFAULT_SPLIT_BYTES) -> None:
        if num_shards < 1:
            raise ValueError(f"need at least one shard, got {num_shards}")
        self.num_shards = num_shards
        self.split_bytes = split_bytes
        self.load = [0] * num_shards

    def place(self, var: str, shape: tuple[int, ...], itemsize: int) -> list[Part]:
        nbytes = math.prod(shape) * itemsize
        rows = shape[0] if shape else 1
        pieces = min(self.num_shards, rows) if nbytes >= self.split_bytes and shape else 1
        if pieces == 1:
            shard = self._least_loaded(set())
            self.load[shard] += nbytes
            return [Part(var, var, shard, 0, rows, True)]
        bounds = np.linspace(0, rows, pieces + 1).round().astype(int)
        parts: list[Part] = []
        used: set[int] = set()
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            shard = self._least_loaded(used)
            used.add(shard)
            self.load[shard] += nbytes * (hi - lo) // rows
            parts.append(Part(var, f"{var}[{lo}:{hi}]", shard, lo, hi, False))
        return parts

    def _least_loaded(self, exclude: set[int]) -> int:
        return min((s for s in range(self.num_shards) if s not in exclude), key=lambda s: (self.load[s], s))
