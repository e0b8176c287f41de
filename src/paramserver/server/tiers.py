"""A PS's memory budget for its tables and its spill space: the tiered tables it makes, and their shares.

With `Options.table_memory_budget` set, every table of the PS is a TieredTable. The budget bounds
the memory tiers of all of them together: it is split evenly, in bytes, between the PS's tables,
and split again when a table is registered (the others then move their least recently touched rows
to disk until they fit their new share). A table's share holds its rows' fields, ids, touch times,
flags and hash index (hot_rows.capacity_for); a share too small for 64 rows gets 64. What a share
does not use is not lent to another table; shrinking a full memory tier copies what it keeps (a
transient, at registration only). On top of the budget: the RocksDB stores' memory
(a block cache and memtables shared by all tables, `StoreMemory`: each a sixteenth of the budget,
64 MiB at most; index and filter blocks, about 2 bytes a row on disk), and a batch's working arrays.
Thread-safety: the owning TableStore calls under its lock.
"""

from __future__ import annotations

import logging

from .embedding_table import RowPolicy
from .hot_rows import capacity_for
from .row_record import RowRecord
from .sparse_optimizers import SparseOptimizer
from .spill_space import SpillSpace
from .spill_store import StoreMemory
from .tiered_table import TieredTable

log = logging.getLogger(__name__)


class Tiers:
    """The tiered tables of one PS, their memory budget and its spill space."""

    def __init__(self, budget: int, space: SpillSpace, memory: StoreMemory | None = None) -> None:
        self.budget = budget
        self.space = space
        self.memory = memory or StoreMemory.for_budget(budget)
        self.tables: list[TieredTable] = []

    @classmethod
    def create(cls, budget: int, spill_dir: str, shard_index: int) -> Tiers:
        """The tiers of shard `shard_index`: its stale spill directories go, a new one is made."""
        return cls(budget, SpillSpace.create(spill_dir, shard_index))

    def new_table(
        self, name: str, dim: int, optimizer: SparseOptimizer, init: dict, spec: dict, policy: RowPolicy
    ) -> TieredTable:
        """A new tiered table with its share of the budget; the other tables' shares shrink to make room."""
        share = self.budget // (len(self.tables) + 1)
        tracks_use = bool(policy.ttl_steps or policy.min_count or policy.max_rows)
        capacity = capacity_for(share, RowRecord(dim, optimizer, tracks_use))
        table = TieredTable(name, dim, optimizer, init, spec, policy, capacity, self.space.table_dir(), self.memory)
        for other in self.tables:
            other.set_capacity(capacity_for(share, other.record))
        self.tables.append(table)
        log.info("table %s keeps up to %d rows in memory (%d bytes of %d)", name, capacity, share, self.budget)
        return table

    def close(self) -> None:
        """Close every table's store and delete the spill space."""
        for table in self.tables:
            table.close()
        self.tables.clear()
        self.space.close()
