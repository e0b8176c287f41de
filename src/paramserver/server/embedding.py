"""An embedding table on a shard: rows keyed by any int64 id, created on first touch.

Rows live in one contiguous (capacity x dim) float32 array, with one array of the same shape
per optimizer state, found through a vectorized HashIndex. A new row is initialized from a
hash of (id, column), so its initial value depends on the id alone: the same on any shard
and in any order of arrival. Not thread-safe: the owning Shard serializes calls.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from .hash_index import HashIndex, mix64
from .sparse_optimizers import SparseOptimizer

_GROWTH = 1.5  # capacity growth of the row arrays: bounds wasted memory at a third


def initial_rows(ids: np.ndarray, dim: int, init: dict) -> np.ndarray:
    """Deterministic initial rows: {"kind": "zeros"} | {"kind": "uniform", "scale": s} | {"kind": "normal", "std": s}."""
    kind = init.get("kind", "normal")
    if kind == "zeros":
        return np.zeros((ids.shape[0], dim), np.float32)
    cols = np.arange(dim, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    bits = mix64((mix64(ids)[:, None] ^ cols).view(np.int64))
    u1 = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)  # in (0, 1)
    if kind == "uniform":
        scale = float(init.get("scale", 0.05))
        return ((u1 * 2 - 1) * scale).astype(np.float32)
    if kind == "normal":
        u2 = ((mix64(bits.view(np.int64)) >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
        normal = np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)
        return (normal * float(init.get("std", 0.01))).astype(np.float32)
    raise InvalidArgumentError(f"unknown initializer {kind!r}; known: zeros, uniform, normal")


class EmbeddingTable:
    """Rows of `dim` float32 values keyed by int64 ids, with a row-wise optimizer."""

    def __init__(self, name: str, dim: int, optimizer: SparseOptimizer, init: dict, spec: dict,
                 capacity: int = 1024) -> None:
        if not isinstance(dim, int) or dim < 1:
            raise InvalidArgumentError(f"table {name!r}: dim must be a positive integer, got {dim!r}")
        initial_rows(np.zeros(1, np.int64), dim, init)  # refuse a bad initializer now
        self.name, self.dim, self.optimizer, self.init, self.spec = name, dim, optimizer, init, spec
        self.index = HashIndex(2 * capacity)
        self.values = np.empty((capacity, dim), np.float32)
        self.state = {key: np.full((capacity, dim), value, np.float32) for key, value in optimizer.state_init().items()}
        if optimizer.hyper.get("per_row_step"):
            self.state["row_step"] = np.zeros(capacity, np.int64)
        self.steps = 0

    @property
    def size(self) -> int:
        return self.index.size

    def rows(self, ids: np.ndarray, create: bool = True) -> np.ndarray:
        """Row numbers of `ids` (distinct), creating missing rows (or -1 for them if not `create`)."""
        rows = self.index.find(ids)
        missing = rows < 0
        if create and missing.any():
            new_ids = ids[missing]
            self._reserve(self.size + new_ids.shape[0])
            new_rows = self.index.insert(new_ids)
            self.values[new_rows] = initial_rows(new_ids, self.dim, self.init)
            rows[missing] = new_rows
        return rows

    def read(self, ids: np.ndarray) -> np.ndarray:
        """The rows of `ids` (distinct), created on first touch; a copy, len(ids) x dim."""
        rows = self.rows(ids)  # first: it may grow (replace) the arrays
        return self.values[rows]

    def apply(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """One optimizer step on the rows of `ids` (distinct) from `grads` (len(ids) x dim)."""
        rows = self.rows(ids)  # first: it may grow (replace) the arrays
        self.steps += 1
        self.optimizer.update(self.values, rows, grads, self.state, self.steps)

    def _reserve(self, needed: int) -> None:
        capacity = self.values.shape[0]
        if needed <= capacity:
            return
        capacity = max(needed, int(capacity * _GROWTH))
        self.values = _grown(self.values, capacity, 0.0)
        for key, array in self.state.items():
            fill = self.optimizer.state_init().get(key, 0)
            self.state[key] = _grown(array, capacity, fill)


def _grown(array: np.ndarray, capacity: int, fill: float) -> np.ndarray:
    grown = np.full((capacity,) + array.shape[1:], fill, array.dtype)
    grown[: array.shape[0]] = array
    return grown
