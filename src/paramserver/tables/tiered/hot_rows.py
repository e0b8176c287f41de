"""The in-memory tier of a tiered table: at most `capacity` rows, found through a HashIndex.

Each field of the table's rows (row_record.RowRecord: values, optimizer state, counters) is one
C-contiguous array of `capacity` rows, taken once at that size: zeros from fresh pages, so that
rows not filled yet cost no resident memory. Per row the tier also keeps its id, when it was last
touched (the table's touch clock: the least recently touched rows go first), whether a copy of it
is on disk, and whether it changed since it was read from there (dirty). Rows are 0..size-1: new
ones are appended; removing rows moves the last rows into the places freed (as many rows copied
as removed, in chunks) and the index forgets or renumbers just those ids (HashIndex.remove), so
memory never holds two of anything and a drop costs in proportion to what it drops.
Not thread-safe: the owning table serializes calls.
"""

from __future__ import annotations

import numpy as np

from paramserver.tables.hash_index import GROW_AT, HashIndex
from paramserver.tables.row_record import RowRecord

_MOVE_ROWS = 1 << 16  # rows moved at a time when compacting
_SLOT_BYTES = 16  # a HashIndex slot: (id, row)
_MIN_ROWS = 64  # the least capacity a table's share gives


def row_bytes(record: RowRecord) -> int:
    """Memory of one row of capacity, the index aside: its fields, id, touch time and two flags."""
    return record.nbytes + 8 + 8 + 2


def index_bytes(capacity: int) -> int:
    """The HashIndex that holds `capacity` rows without growing (HashIndex.holding)."""
    return _SLOT_BYTES * HashIndex.holding(capacity).capacity


def capacity_for(budget: int, record: RowRecord) -> int:
    """The most rows whose arrays and index fit in `budget` bytes (at least _MIN_ROWS)."""
    best, slots = 0, 16
    while slots * _SLOT_BYTES < budget:  # each power of two of slots: the rows that fit beside it
        held = int(slots * GROW_AT)  # what that many slots hold before the index grows
        best = max(best, min(held, (budget - slots * _SLOT_BYTES) // row_bytes(record)))
        slots *= 2
    return max(best, _MIN_ROWS)


class HotRows:
    """Rows in memory, each with its id, touch time and disk flags."""

    def __init__(self, record: RowRecord, capacity: int) -> None:
        self.record = record
        self.capacity = capacity
        self.fields = {
            name: np.zeros((capacity, *record.dtype[name].shape), record.dtype[name].base) for name in record.names
        }
        self.ids = np.zeros(capacity, np.int64)
        self.touched = np.zeros(capacity, np.int64)  # the table's touch clock when last looked up or updated
        self.on_disk = np.zeros(capacity, bool)  # a copy is on disk (stale when dirty)
        self.dirty = np.zeros(capacity, bool)  # changed since read from disk (or never written there)
        self.index = HashIndex.holding(capacity)
        self._row_items = {name: _row_items(array) for name, array in self.fields.items()}

    @property
    def size(self) -> int:
        return self.index.size

    @property
    def free(self) -> int:
        return self.capacity - self.size

    @property
    def values(self) -> np.ndarray:
        return self.fields["values"]

    def optimizer_state(self) -> dict[str, np.ndarray]:
        """The arrays a SparseOptimizer updates: its state, and row_step when kept."""
        return {name: self.fields[name] for name in (*self.record.state_names, "row_step") if name in self.fields}

    @property
    def nbytes(self) -> int:
        return self.capacity * row_bytes(self.record) + self.index.nbytes

    def find(self, ids: np.ndarray) -> np.ndarray:
        return self.index.find(ids)

    def add(self, ids: np.ndarray, records: np.ndarray, clock: int, on_disk: bool) -> np.ndarray:
        """Append rows (ids absent, distinct, and room for them); returns their row numbers.
        A row read from disk comes clean; any other is dirty (it is nowhere else)."""
        rows = self.index.insert(ids)
        self.ids[rows] = ids
        for name, array in self.fields.items():
            array[rows] = records[name]
        self.touched[rows] = clock
        self.on_disk[rows] = on_disk
        self.dirty[rows] = not on_disk
        return rows

    def records(self, rows: np.ndarray) -> np.ndarray:
        """The rows' fields as records (a copy)."""
        records = self.record.empty(rows.shape[0])
        for name, array in self.fields.items():
            records[name] = array[rows]
        return records

    def least_recent(self, count: int, clock: int) -> np.ndarray:
        """Up to `count` rows least recently touched, of those not touched at `clock` (in use now)."""
        touched = self.touched[: self.size]
        oldest = int(touched.min()) if touched.shape[0] else clock
        if clock - oldest > 4 * max(touched.shape[0], 1):  # touch times too spread for a count of each
            idle = np.flatnonzero(touched < clock)
            if idle.shape[0] <= count:
                return idle
            return idle[np.argpartition(touched[idle], count - 1)[:count]]
        # a count of rows per touch time finds the cutoff: every row older, then enough of those at it
        older_than = np.cumsum(np.bincount(touched - oldest, minlength=clock - oldest))
        cutoff = oldest + min(int(np.searchsorted(older_than, count)), clock - oldest)
        older = np.flatnonzero(touched < cutoff)
        if cutoff == clock or older.shape[0] >= count:
            return older[:count]
        return np.concatenate([older, np.flatnonzero(touched == cutoff)[: count - older.shape[0]]])

    def remove(self, rows: np.ndarray) -> None:
        """Drop these rows (distinct). The last rows move into the places they free, so rows stay
        0..size-1 and a drop costs a copy of as many rows as it drops, not of the whole tier, and
        no index rebuild: the index forgets the dropped ids and renumbers the moved ones."""
        if not rows.shape[0]:
            return
        left = self.size - rows.shape[0]
        in_tail = np.zeros(rows.shape[0], bool)  # which of the last rows.shape[0] rows are dropped
        in_tail[rows[rows >= left] - left] = True
        movers = left + np.flatnonzero(~in_tail)
        holes = np.sort(rows[rows < left])  # as many as movers
        self.index.remove(self.ids[rows])
        if not movers.shape[0]:
            return
        self.index.remove(self.ids[movers])
        for array in (*self._row_items.values(), self.ids, self.touched, self.on_disk, self.dirty):
            for lo in range(0, movers.shape[0], _MOVE_ROWS):
                array[holes[lo : lo + _MOVE_ROWS]] = array[movers[lo : lo + _MOVE_ROWS]]
        self.index.place(self.ids[holes], holes)

    def _reindex(self, size: int) -> None:
        del self.index  # freed before the new one is made
        self.index = HashIndex.holding(self.capacity)
        self.index.insert(self.ids[:size])

    def resize(self, capacity: int) -> None:
        """Hold at most `capacity` rows from now on (the rows held must fit)."""
        size = self.size
        moved = HotRows(self.record, capacity)
        for name, array in self.fields.items():
            moved.fields[name][:size] = array[:size]
        for name in ("ids", "touched", "on_disk", "dirty"):
            getattr(moved, name)[:size] = getattr(self, name)[:size]
        del self.index
        moved._reindex(size)
        self.__dict__.update(moved.__dict__)


def _row_items(array: np.ndarray) -> np.ndarray:
    """`array` (rows first, C-contiguous) seen as one opaque item per row: a fancy index of it copies
    each row with one memcpy (a field of several columns is otherwise copied column by column)."""
    width = array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))
    return array.reshape(array.shape[0], -1).view(np.dtype((np.void, width))).reshape(array.shape[0])


def _zeros(capacity: int, field: np.dtype) -> np.ndarray:
    """`capacity` rows of one record field, as a native C-contiguous array (fresh pages: no RSS yet)."""
    return np.zeros((capacity, *field.shape), field.base.newbyteorder("="))
