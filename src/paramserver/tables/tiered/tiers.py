"""A PS's memory budget for its tables and its spill space: the tiered tables it makes, and their shares.

With `Options.table_memory_budget` set, every table of the PS is a TieredTable. The budget bounds
the memory tiers of all of them together: it is split evenly, in bytes, between the PS's tables,
and split again when a table is registered (the others then move their least recently touched rows
to disk until they fit their new share). A table's share holds its rows' fields, ids, touch times,
flags and hash index (hot_rows.capacity_for); a share too small for 64 rows gets 64. What a share
does not use is not lent to another table; shrinking a full memory tier copies what it keeps (a
transient, at registration only). On top of the budget: the RocksDB stores' memory
(a block cache and memtables shared by all tables, `StoreMemory`: each a sixteenth of the budget,
64 MiB at most; index and filter blocks, about 2 bytes a row on disk), each table's write-back
queue (write_back.py: 4 slices of at most 32,768 records, 17 MiB at dim 16 with Adagrad), and a
batch's working arrays.
The tables' stores share one SpillCondition (spill_condition.py): a full disk, or a failed store,
is the PS's, reported with its cause to the PS node (health, recovery). `check` (the PS's main
thread, about once a second) also finds a spill subdirectory removed or replaced, and a disk full
for longer than its grace (`Options.spill_full_grace_s`). Thread-safety: the owning TableStore calls
under its lock; `check` from any thread.
"""

from __future__ import annotations

import logging

from paramserver.tables.embedding_table import RowPolicy
from paramserver.tables.row_record import RowRecord
from paramserver.tables.sparse_optimizers import SparseOptimizer
from paramserver.tables.tiered.hot_rows import capacity_for
from paramserver.tables.tiered.spill_condition import FULL_GRACE_S, SpillCondition
from paramserver.tables.tiered.spill_space import SpillSpace
from paramserver.tables.tiered.spill_store import SpillError, StoreMemory
from paramserver.tables.tiered.tiered_table import TieredTable

log = logging.getLogger(__name__)


class Tiers:
    """The tiered tables of one PS, their memory budget and its spill space."""

    def __init__(
        self, budget: int, space: SpillSpace, memory: StoreMemory | None = None, condition: SpillCondition | None = None
    ) -> None:
        self.budget = budget
        self.space = space
        self.memory = memory or StoreMemory.for_budget(budget)
        self.condition = condition or SpillCondition()
        self.tables: list[TieredTable] = []

    @classmethod
    def create(cls, budget: int, spill_dir: str, shard_index: int, full_grace_s: float = FULL_GRACE_S) -> Tiers:
        """The tiers of shard `shard_index`: its stale spill directories go, a new one is made; a disk
        full for longer than `full_grace_s` fails the shard."""
        return cls(budget, SpillSpace.create(spill_dir, shard_index), condition=SpillCondition(full_grace_s))

    def new_table(
        self, name: str, dim: int, optimizer: SparseOptimizer, init: dict, spec: dict, policy: RowPolicy
    ) -> TieredTable:
        """A new tiered table with its share of the budget; the other tables' shares shrink to make room."""
        share = self.budget // (len(self.tables) + 1)
        tracks_use = bool(policy.ttl_steps or policy.min_count or policy.max_rows)
        capacity = capacity_for(share, RowRecord(dim, optimizer, tracks_use))
        table = TieredTable(
            name, dim, optimizer, init, spec, policy, capacity, self._table_dir(), self.memory, self.condition
        )
        for other in self.tables:
            other.set_capacity(capacity_for(share, other.record))
        self.tables.append(table)
        log.info("table %s keeps up to %d rows in memory (%d bytes of %d)", name, capacity, share, self.budget)
        return table

    def _table_dir(self) -> str:
        if self.condition.failed:
            raise SpillError(f"spill directory {self.space.path}: {self.condition.cause}")
        try:
            return self.space.table_dir()
        except OSError as exc:
            cause = f"spill directory {self.space.path}: cannot make a table's directory: {exc}"
            self.condition.fail(cause)
            raise SpillError(cause) from exc

    def check(self) -> str:
        """Look at the spill subdirectory and how long a full disk lasted; returns the condition's state."""
        return self.condition.check(self.space.problem())

    def close(self) -> None:
        """Close every table's store and delete the spill space: only while it is still the
        subdirectory this PS made (else nothing there is deleted). Never raises."""
        own = self.space.problem() is None
        for table in self.tables:
            table.close(delete=own)
        self.tables.clear()
        self.space.close()
