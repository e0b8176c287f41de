"""What a shard asks of an embedding table, whichever kind holds its rows.

Two kinds implement `Table`: EmbeddingTable (embedding_table.py: every row in memory) and
TieredTable (tiered/tiered_table.py: hot rows in memory, the rest on disk), with the same results
for the same calls. TableStore makes one or the other (tiered when the PS has a
table_memory_budget) and calls them through this interface; mypy checks both against it
(table_store.py). What only one kind offers (change stamps and deltas of the in-memory table, the
capacity of the tiered one's memory tier) is asked of that class by name.

Not thread-safe: the owning TableStore's lock of the table serializes every call, a `row_chunks` iteration and a
snapshot's reads included.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np

from paramserver.tables.embedding_table import RowPolicy
from paramserver.tables.row_snapshot import FrozenSnapshot, RowSnapshot
from paramserver.tables.sparse_optimizers import SparseOptimizer


class Table(Protocol):
    """Rows of `dim` float32 values keyed by int64 ids, created on first lookup (as `policy`
    admits them) and trained by a row-wise `optimizer`. `spec` and `init` are the optimizer and
    initializer as registered (a checkpoint saves and checks them); `counters` and `steps` (the
    table's updates) are saved with its rows."""

    name: str
    dim: int
    init: dict
    spec: dict
    policy: RowPolicy
    optimizer: SparseOptimizer
    counters: dict[str, int]
    steps: int

    @property
    def size(self) -> int:
        """Rows held."""
        ...

    def read(self, ids: np.ndarray) -> np.ndarray:
        """The rows of `ids`, admitted on first touch; a copy, len(ids) x dim (an id not admitted
        reads as its initial values)."""
        ...

    def apply(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """One optimizer step on the rows of `ids` (distinct) from `grads` (len(ids) x dim)."""
        ...

    def evict(self) -> int:
        """Drop rows by the policy's eviction rules; returns how many."""
        ...

    def layout(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """What a saved row holds: array name -> (dtype, shape of one row), in file order."""
        ...

    def row_chunks(self, chunk_rows: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(first row, {array name: rows}) for consecutive chunks of every row, every `layout()` array."""
        ...

    def begin_snapshot(self, slice_rows: int, budget_bytes: int) -> RowSnapshot | FrozenSnapshot:
        """Start a checkpoint's view of the rows as they are now; `end_snapshot` ends it."""
        ...

    def end_snapshot(self) -> None: ...

    def load_rows(self, ids: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        """Add saved rows (a restore, a chunk at a time); InvalidArgumentError for an id twice."""
        ...

    def restore_meta(self, counters: dict[str, int], steps: int) -> None:
        """Set the counters and update count a checkpoint saved (after its rows are loaded)."""
        ...

    def describe(self) -> dict:
        """Rows, dim, updates, counters and bytes held (a kind may add its own entries)."""
        ...
