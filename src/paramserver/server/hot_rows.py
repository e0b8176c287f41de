"""The in-memory tier of a tiered table: at most `capacity` rows, found through a HashIndex.

Each field of the table's rows (row_record.RowRecord: values, optimizer state, counters) is one
C-contiguous array of `capacity` rows, taken once at that size: zeros from fresh pages, so that
rows not filled yet cost no resident memory. Per row the tier also keeps its id, when it was last
touched (the table's touch clock: the least recently touched rows go first), whether it holds a
row now (alive), whether a copy of it is on disk, and whether it changed since it was read from
there (dirty).

Rows never move (but when the capacity changes): a row removed frees its place (a stack of free
rows), which the next row added takes. The index maps an id to an *entry*, and `_rows_of` an entry
to its row; the index cannot delete, so an entry outlives its row: a row removed sets its entry's
row to none, and an id added again takes its old entry back (no new one). Entries of ids that are
gone pile up until the index has no room for new ones (it has at least capacity / 3 spare
entries): then it is rebuilt from the rows alive, one pass over them, the old one freed first
(measured: 25 ms for 700,000 rows, once per 300,000 or more rows added). So dropping rows costs
no compaction and no index rebuild, and a row read from disk keeps its place until it leaves.
Not thread-safe: the owning table serializes calls.
"""

from __future__ import annotations

import numpy as np

from .embedding_table import gather_rows
from .hash_index import GROW_AT, HashIndex
from .row_record import RowRecord

_SLOT_BYTES = 16  # a HashIndex slot: (id, entry)
_MIN_ROWS = 64  # the least capacity a table's share gives
_SPARE = 4  # at least 1/_SPARE of the index's entries are spare when it is full of rows


def _position_type(capacity: int) -> np.dtype:
    return np.dtype(np.int32 if capacity < 1 << 31 else np.int64)


def row_bytes(record: RowRecord, capacity: int = 0) -> int:
    """Memory of one row of capacity, the index aside: its fields, id, touch time, where it is on
    disk, three flags and its place in the stack of free rows."""
    return record.nbytes + 8 + 8 + 8 + 3 + _position_type(capacity).itemsize


def index_slots(capacity: int) -> int:
    """Slots of the HashIndex of `capacity` rows: a power of two that holds, without growing
    (HashIndex.holding), at least capacity * _SPARE / (_SPARE - 1) entries."""
    return HashIndex.holding(-(-capacity * _SPARE // (_SPARE - 1))).capacity


def _entries(slots: int) -> int:
    """Entries an index of `slots` slots holds before it would grow."""
    return int(slots * GROW_AT)


def index_bytes(capacity: int) -> int:
    """The HashIndex of `capacity` rows and the entry -> row map (half as many entries as slots)."""
    slots = index_slots(capacity)
    return _SLOT_BYTES * slots + _entries(slots) * _position_type(capacity).itemsize


def capacity_for(budget: int, record: RowRecord) -> int:
    """The most rows whose arrays and index fit in `budget` bytes (at least _MIN_ROWS)."""
    best, slots = 0, 16
    while slots * _SLOT_BYTES < budget:  # each power of two of slots: the rows that fit beside it
        entries = _entries(slots)
        room = budget - slots * _SLOT_BYTES - entries * _position_type(entries).itemsize
        rows = min(entries * (_SPARE - 1) // _SPARE, room // row_bytes(record, entries))
        best = max(best, rows)
        slots *= 2
    return max(best, _MIN_ROWS)


class HotRows:
    """Rows in memory, each with its id, touch time and disk flags."""

    def __init__(self, record: RowRecord, capacity: int) -> None:
        self.record = record
        self.capacity = capacity
        position = _position_type(capacity)
        self.fields = {
            name: np.zeros((capacity, *record.dtype[name].shape), record.dtype[name].base) for name in record.names
        }
        self.ids = np.zeros(capacity, np.int64)
        self.touched = np.zeros(capacity, np.int64)  # the table's touch clock when last looked up or updated
        self.alive = np.zeros(capacity, bool)  # the row holds an id now
        self.on_disk = np.zeros(capacity, bool)  # a copy is on disk (stale when dirty)
        self.dirty = np.zeros(capacity, bool)  # changed since read from disk (or never written there)
        self.place = np.zeros(capacity, np.int64)  # where it was read from on disk (SpillStore.get), or -1
        self._free = np.empty(capacity, position)  # a stack of rows removed, the last taken first
        self._free_count = 0
        self._fresh = 0  # rows from here on were never used (their pages not touched yet)
        self._slots = index_slots(capacity)
        self.index = HashIndex(self._slots)
        self._rows_of = np.zeros(
            _entries(self._slots) + 1, position
        )  # index entry -> row + 1, 0: none (the last: always)
        self._row_items = {name: _row_items(array) for name, array in self.fields.items()}
        self.size = 0
        self.rebuilds = 0
        self.generation = 0  # changes whenever an id gains or loses its row

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
        return self.capacity * row_bytes(self.record, self.capacity) + index_bytes(self.capacity)

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Row of each id, or -1 where it has none in memory."""
        return self.locate(ids)[0]

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row, entry) of each id: its row or -1, and its index entry or -1 (an id not in memory
        may have one, from when it was: `add` takes it back)."""
        entries = self.index.find(np.ascontiguousarray(ids, np.int64))
        return self._rows_of[entries].astype(np.int64) - 1, entries  # entry -1 reads the last: always none

    def add(
        self,
        ids: np.ndarray,
        entries: np.ndarray,
        rows_in: np.ndarray | dict[str, np.ndarray],
        clock: int,
        places: np.ndarray | None = None,
    ) -> np.ndarray:
        """Put rows (ids absent, distinct, and room for them; `entries` as `locate` gave them) in
        free places; returns their row numbers. `rows_in`: their records, or some of their fields
        (the others take their initial value). A row read from disk (`places`: where it was found
        there) comes clean; any other is dirty (it is nowhere else)."""
        n = ids.shape[0]
        reused = min(n, self._free_count)
        rows = np.empty(n, np.int64)
        rows[:reused] = self._free[self._free_count - reused : self._free_count][::-1]
        rows[reused:] = np.arange(self._fresh, self._fresh + n - reused)
        self._free_count -= reused
        self._fresh += n - reused
        new = entries < 0
        self.ids[rows] = ids
        self.alive[rows] = True
        if self.index.size + int(new.sum()) > _entries(self._slots):
            self._rebuild()
        else:
            self._rows_of[entries[~new]] = rows[~new] + 1  # an id back in memory takes its old entry
            if new.any():
                self._rows_of[self.index.insert(ids[new])] = rows[new] + 1
        if isinstance(rows_in, dict):
            for name, array in self.fields.items():
                given = rows_in.get(name)
                if given is None:
                    array[rows] = self.record.fill[name]
                else:
                    self._row_items[name][rows] = _row_items(np.ascontiguousarray(given, array.dtype))
        else:  # records: each field's bytes copied row by row (a memcpy each)
            raw = np.ascontiguousarray(rows_in).view(np.uint8).reshape(n, self.record.nbytes)
            for name, items in self._row_items.items():
                at = self.record.offset(name)
                items[rows] = raw[:, at : at + items.dtype.itemsize].view(items.dtype)[:, 0]
        self.touched[rows] = clock
        self.generation += 1
        self.on_disk[rows] = places is not None
        self.dirty[rows] = places is None
        self.place[rows] = -1 if places is None else places
        self.size += n
        return rows

    def _rebuild(self) -> None:
        """A new index of the rows alive (the old one freed first): its stale entries go."""
        live = np.flatnonzero(self.alive)
        del self.index
        self.index = HashIndex(self._slots)
        self._rows_of[self.index.insert(self.ids[live])] = live + 1
        self.rebuilds += 1

    def records(self, rows: np.ndarray) -> np.ndarray:
        """The rows' fields as records (a copy)."""
        records = self.record.empty(rows.shape[0])
        for name, array in self.fields.items():
            records[name] = gather_rows(array, rows) if array.ndim == 2 else array.take(rows)
        return records

    def live(self) -> np.ndarray:
        """The rows alive, in row order."""
        return np.flatnonzero(self.alive)

    def least_recent(self, count: int, clock: int) -> np.ndarray:
        """Up to `count` rows least recently touched, of those not touched at `clock` (in use now)."""
        touched = np.where(self.alive, self.touched, clock)  # rows not alive count as in use
        oldest = int(touched.min())
        if clock - oldest > 4 * self.capacity:  # touch times too spread for a count of each
            idle = np.flatnonzero(touched < clock)
            if idle.shape[0] <= count:
                return idle
            return idle[np.argpartition(touched[idle], count - 1)[:count]]
        # how many rows have each touch time: all rows older than the cutoff time, then enough of those at it
        at_least = np.cumsum(np.bincount(touched - oldest))
        cutoff = oldest + min(int(np.searchsorted(at_least, count)), clock - oldest)
        older = np.flatnonzero(touched < cutoff)
        if cutoff == clock or older.shape[0] >= count:
            return older[:count]
        return np.concatenate([older, np.flatnonzero(touched == cutoff)[: count - older.shape[0]]])

    def remove(self, rows: np.ndarray) -> None:
        """Drop these rows (alive, distinct); their places are free for the next rows added."""
        if not rows.shape[0]:
            return
        self._rows_of[self.index.find(self.ids[rows])] = 0  # their entries stay, pointing nowhere
        self.alive[rows] = False
        self.generation += 1
        self._free[self._free_count : self._free_count + rows.shape[0]] = rows
        self._free_count += rows.shape[0]
        self.size -= rows.shape[0]

    def resize(self, capacity: int) -> None:
        """Hold at most `capacity` rows from now on (the rows held must fit); they are renumbered."""
        live = self.live()
        moved = HotRows(self.record, capacity)
        for name, array in self.fields.items():
            moved.fields[name][: live.shape[0]] = array[live]
        for name in ("ids", "touched", "alive", "on_disk", "dirty", "place"):
            getattr(moved, name)[: live.shape[0]] = getattr(self, name)[live]
        moved._fresh = live.shape[0]
        moved.size = live.shape[0]
        del self.index
        moved._rebuild()
        moved.rebuilds = self.rebuilds
        moved.generation = self.generation + 1
        self.__dict__.update(moved.__dict__)


def _row_items(array: np.ndarray) -> np.ndarray:
    """`array` (rows first, C-contiguous) seen as one opaque item per row: a fancy index of it copies
    each row with one memcpy (a field of several columns is otherwise copied column by column)."""
    columns = int(np.prod(array.shape[1:], dtype=np.int64))
    width = array.dtype.itemsize * columns
    return array.reshape(array.shape[0], columns).view(np.dtype((np.void, width))).reshape(array.shape[0])
