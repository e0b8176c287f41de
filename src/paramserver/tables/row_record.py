"""One row of a tiered table as a fixed-size record: how a row travels between memory and disk.

A record holds everything a row is, so that a row's values, optimizer state and counters move
together: "values" and each optimizer state (float32, dim wide), "row_step" (int64, Adam with
per_row_step), and with an eviction rule "last_seen", "seen" (int64, as EmbeddingTable keeps
them) and "born" (int64: the order rows were admitted in, which breaks max_rows' ties as an
EmbeddingTable's row order does). The id is the record's key, not part of it.
"""

from __future__ import annotations

import numpy as np

from paramserver.tables.sparse_optimizers import SparseOptimizer

USE_FIELDS = ("last_seen", "seen", "born")  # kept only when an eviction rule needs them


class RowRecord:
    """The fields of one table's rows: a numpy structured dtype and each field's initial value."""

    def __init__(self, dim: int, optimizer: SparseOptimizer, tracks_use: bool) -> None:
        self.dim = dim
        self.fill: dict[str, float] = {"values": 0.0, **optimizer.state_init()}
        self.state_names = tuple(optimizer.state_init())  # float32 optimizer state, in the optimizer's order
        if optimizer.hyper.get("per_row_step"):
            self.fill["row_step"] = 0
        if tracks_use:
            self.fill.update(dict.fromkeys(USE_FIELDS, 0))
        self.dtype = np.dtype([(name, *self._type(name)) for name in self.fill])

    def _type(self, name: str) -> tuple:
        return ("<f4", (self.dim,)) if name == "values" or name in self.state_names else ("<i8",)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.fill)

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize

    def empty(self, n: int) -> np.ndarray:
        return np.empty(n, self.dtype)

    def from_arrays(self, n: int, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """`n` records from per-field arrays; a field `arrays` lacks takes its initial value."""
        records = self.empty(n)
        for name in self.names:
            records[name] = arrays[name] if name in arrays else self.fill[name]
        return records
