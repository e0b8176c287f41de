"""An embedding table bigger than memory: hot rows in memory, the rest on local disk.

The same interface and the same training results as EmbeddingTable (bit for bit: the same
initial rows, admissions, optimizer kernels and eviction rules), over two tiers:
- HotRows (hot_rows.py): at most `capacity` rows in memory, the table's share of the PS's budget;
- SpillStore (spill_store.py): every other row, in RocksDB under the PS's spill directory.
A row is read from disk on its first lookup (or update) while it is not in memory, and stays on
disk as well: clean, it is simply dropped from memory later; changed (an update, or a lookup that
counts its use), it is written back when it leaves. Values, optimizer state and counters move
together, as one record (row_record.py).

Which rows stay in memory: the least recently touched go first. Every read or update of a batch
(every 64k distinct ids of it) advances a touch clock and stamps the rows it touches. The table
keeps a list of candidates to drop: an eighth of its capacity, least recently stamped first,
chosen at once (the choice costs in proportion to the tier's size). When new rows need room, the
memory tier drops just as many of them, skipping those touched since they were chosen (never
rows of the batch in hand), and chooses again when the list is used up (HotRows.remove: a drop
costs in proportion to the rows dropped, whatever the tier's size).

Dropped rows that changed are written to disk off the request path (write_back.py): the request
moves them into a bounded queue, a slice at a time, and a thread of the table's own writes them;
a request waits only while that queue is full (the writer is behind), for one slice. Until it is
written a queued row is read from the queue. What reads or changes the disk as a whole (the
eviction rules, a checkpoint's rows, a restore) first waits for the queue to empty.

The table keeps no index of its rows on disk (that is RocksDB's): memory holds the hot rows, the
ids looked up but not admitted yet (as EmbeddingTable does) and counts. Not thread-safe:
TableStore's lock serializes every call, row_chunks' iteration included (the store's reader
threads only serve the get in hand; the writer thread only writes queued slices to the store).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from paramserver.base.errors import InvalidArgumentError
from paramserver.base.hashing import count_distinct
from paramserver.tables.embedding_table import RowPolicy, gather_rows, initial_rows
from paramserver.tables.row_admission import Admission
from paramserver.tables.row_record import RowRecord
from paramserver.tables.row_snapshot import FrozenSnapshot
from paramserver.tables.sparse_optimizers import SparseOptimizer
from paramserver.tables.tiered.hot_rows import HotRows
from paramserver.tables.tiered.spill_condition import OK, SpillCondition
from paramserver.tables.tiered.spill_store import SpillStore, StoreMemory
from paramserver.tables.tiered.tiered_eviction import keep_rule
from paramserver.tables.tiered.write_back import SLICE_ROWS, WriteBack

_BATCH = 1 << 16  # distinct ids handled at a time: one tick of the touch clock
_SCAN = 1 << 16  # disk rows read at a time by a scan (eviction rules, row_chunks)
_EVICT_FRACTION = 8  # a full memory tier chooses capacity / 8 rows to drop at once (then drops what it needs)


class TieredTable:
    """Rows of `dim` float32 values keyed by int64 ids: the hot ones in memory, the rest on disk."""

    def __init__(
        self,
        name: str,
        dim: int,
        optimizer: SparseOptimizer,
        init: dict,
        spec: dict,
        policy: RowPolicy,
        capacity: int,
        store_dir: str,
        memory: StoreMemory,
        condition: SpillCondition | None = None,
    ) -> None:
        if not isinstance(dim, int) or dim < 1:
            raise InvalidArgumentError(f"table {name!r}: dim must be a positive integer, got {dim!r}")
        initial_rows(np.zeros(1, np.int64), dim, init)  # refuse a bad initializer now
        self.name, self.dim, self.optimizer, self.init, self.spec = name, dim, optimizer, init, spec
        self.policy = policy
        self.tracks_use = bool(policy.ttl_steps or policy.min_count or policy.max_rows)
        self.record = RowRecord(dim, optimizer, self.tracks_use)
        self.hot = HotRows(self.record, capacity)
        self.store = SpillStore(store_dir, self.record, memory, condition)
        self.write_back = WriteBack(self.store, name, min(SLICE_ROWS, max(16, capacity // 16)))
        self.admission = Admission(policy)
        self.counters = {"admitted": 0, "not_admitted_lookups": 0, "dropped_gradients": 0, "evicted": 0}
        self.steps = 0
        self.snapshot: FrozenSnapshot | None = None  # a checkpoint's view, while one is written
        self._clock = 0  # touch clock: advances with every batch read or updated
        self._born = 0  # rows admitted or loaded so far: each row's admission number
        self._spilled = 0  # rows on disk (some also in memory)
        self._memory_only = 0  # rows in memory with no copy on disk
        self._candidates = np.zeros(0, np.int64)  # ids to drop next: the least recently touched, as chosen
        self._chosen_at = 0  # the touch clock when they were chosen: a row touched since stays

    @property
    def size(self) -> int:
        return self._spilled + self._memory_only

    @property
    def _batch(self) -> int:
        return max(1, min(_BATCH, self.hot.capacity // 2))  # a batch and its room fit beside each other

    def read(self, ids: np.ndarray) -> np.ndarray:
        """The rows of `ids`, admitted on first touch; a copy, len(ids) x dim. An id not admitted
        yet reads as its initial values."""
        self.write_back.check()
        distinct, where = np.unique(np.ascontiguousarray(ids, np.int64), return_inverse=True)
        out = np.empty((distinct.shape[0], self.dim), np.float32)
        for lo in range(0, distinct.shape[0], self._batch):
            part = distinct[lo : lo + self._batch]
            rows = self._rows(part, create=True)
            stored = rows >= 0
            if self.tracks_use:
                self.hot.fields["last_seen"][rows[stored]] = self.steps
                self.hot.fields["seen"][rows[stored]] += 1
                self.hot.dirty[rows[stored]] = True
            if stored.all():
                out[lo : lo + part.shape[0]] = gather_rows(self.hot.values, rows)
            else:
                block = initial_rows(part, self.dim, self.init)
                block[stored] = gather_rows(self.hot.values, rows[stored])
                out[lo : lo + part.shape[0]] = block
        return out[where.reshape(-1)]

    def apply(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """One optimizer step on the rows of `ids` (distinct) from `grads` (len(ids) x dim).
        Gradients of ids without a row (not admitted, or evicted) are dropped and counted."""
        ids = np.ascontiguousarray(ids, np.int64)
        self.write_back.check()
        self.steps += 1
        state = self.hot.optimizer_state()
        for lo in range(0, ids.shape[0], self._batch):
            rows, part = self._rows(ids[lo : lo + self._batch], create=False), grads[lo : lo + self._batch]
            stored = rows >= 0
            self.counters["dropped_gradients"] += int((~stored).sum())
            if stored.all():
                self.optimizer.update(self.hot.values, rows, part, state, self.steps)
            elif stored.any():
                self.optimizer.update(self.hot.values, rows[stored], part[stored], state, self.steps)
            self.hot.dirty[rows[stored]] = True
        if self.policy.evict_every and self.steps % self.policy.evict_every == 0:
            self.evict()

    def _rows(self, ids: np.ndarray, create: bool) -> np.ndarray:
        """Memory rows of `ids` (distinct, at most a batch): read from disk where there, admitted
        by the policy where nowhere (with `create`); -1 where no row."""
        self._clock += 1
        rows = self.hot.find(ids)
        hit = rows >= 0
        self.hot.touched[rows[hit]] = self._clock
        if hit.all():
            return rows
        missing = np.flatnonzero(~hit)
        on_disk, records = self._disk_rows(ids[missing])
        fresh = missing[~on_disk]
        if create and fresh.shape[0]:
            admit = self.admission.admit(ids[fresh])
            self.counters["admitted"] += int(admit.sum())
            self.counters["not_admitted_lookups"] += int((~admit).sum())
            fresh = fresh[admit]
        else:
            fresh = fresh[:0]
        if self._make_room(records.shape[0] + fresh.shape[0]):  # memory rows moved
            rows[hit] = self.hot.find(ids[hit])
        if records.shape[0]:
            rows[missing[on_disk]] = self.hot.add(ids[missing[on_disk]], records, self._clock, on_disk=True)
        if fresh.shape[0]:
            rows[fresh] = self.hot.add(ids[fresh], self._new_records(ids[fresh]), self._clock, on_disk=False)
            self._memory_only += fresh.shape[0]
        return rows

    def _new_records(self, ids: np.ndarray) -> np.ndarray:
        records = self.record.from_arrays(ids.shape[0], {"values": initial_rows(ids, self.dim, self.init)})
        if self.tracks_use:
            records["born"] = np.arange(self._born, self._born + ids.shape[0])
        self._born += ids.shape[0]
        return records

    def _disk_rows(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, records) of `ids` not in memory: queued for disk (the newest copy) or on disk."""
        if not self.write_back.rows:
            return self.store.get(ids)
        queued, from_queue = self.write_back.find(ids)
        if queued.all():
            return queued, from_queue
        on_disk, from_disk = self.store.get(ids[~queued])
        found = queued.copy()
        found[~queued] = on_disk
        records = np.empty(int(found.sum()), self.record.dtype)
        records[queued[found]] = from_queue
        records[~queued[found]] = from_disk
        return found, records

    def _make_room(self, needed: int) -> bool:
        """Drop rows if `needed` more do not fit; returns whether it did (memory rows moved)."""
        excess = self.hot.size + needed - self.hot.capacity
        if excess <= 0:
            return False
        self._drop(self._victims(excess))
        return True

    def _victims(self, count: int) -> np.ndarray:
        """Ids of `count` rows to drop (fewer only when the rest are all in use now): the next
        candidates not touched since they were chosen, chosen again when none are left."""
        taken: list[np.ndarray] = []
        wanted, fresh = count, False
        while True:  # the list, then a new list if it ran out
            while wanted and self._candidates.shape[0]:
                ids = self._candidates[:wanted]
                self._candidates = self._candidates[wanted:]
                rows = self.hot.find(ids)
                idle = rows >= 0
                idle[idle] = self.hot.touched[rows[idle]] < self._chosen_at
                self.hot.touched[rows[idle]] = self._clock  # taken: not chosen again below
                taken.append(ids[idle])
                wanted -= taken[-1].shape[0]
            if not wanted or fresh:
                break
            chosen = self.hot.least_recent(max(wanted, self.hot.capacity // _EVICT_FRACTION), self._clock)
            self._candidates, self._chosen_at, fresh = self.hot.ids[chosen], self._clock, True
        return np.concatenate(taken) if taken else np.zeros(0, np.int64)

    def _drop(self, ids: np.ndarray) -> None:
        """Move these rows (in memory) out of it, a slice at a time: queued for disk if changed,
        else only dropped. Waits while the write-back queue is full; a slice is dropped whole or
        not at all (SpillError: the rest stay in memory)."""
        for lo in range(0, ids.shape[0], self.write_back.slice_rows):
            rows = self.hot.find(ids[lo : lo + self.write_back.slice_rows])
            changed = rows[self.hot.dirty[rows]]
            if changed.shape[0]:
                self.write_back.put(self.hot.ids[changed], self.hot.records(changed))
            new_on_disk = int((~self.hot.on_disk[rows]).sum())
            self._spilled += new_on_disk
            self._memory_only -= new_on_disk
            self.hot.remove(rows)

    def set_capacity(self, capacity: int) -> None:
        """Hold at most `capacity` rows in memory from now on (the budget's share changed)."""
        if self.hot.size > capacity:
            self._drop(self.hot.ids[self.hot.least_recent(self.hot.size - capacity, self._clock + 1)])
        self.hot.resize(capacity)
        self._candidates = self._candidates[:0]

    # ---- eviction rules ---------------------------------------------------------------------
    def evict(self) -> int:
        """Drop rows by the policy (ttl, min_count, max_rows), from memory and disk alike; returns how many."""
        if not self.tracks_use:
            return 0
        self.write_back.drain()  # the rules see, and delete from, the disk's rows as a whole
        keep = keep_rule(self.policy, self.steps, self._use_chunks)
        evicted = 0
        for ids, records in self._cold_chunks(_SCAN):  # rows on disk only: memory's copies are newer
            drop = ~keep(records)
            if drop.any():
                self.store.delete(ids[drop])
                self._spilled -= int(drop.sum())
                evicted += int(drop.sum())
        drop = np.flatnonzero(~keep(self._hot_fields()))
        if drop.shape[0]:
            on_disk = self.hot.on_disk[drop]
            self.store.delete(self.hot.ids[drop[on_disk]])
            self._spilled -= int(on_disk.sum())
            self._memory_only -= int((~on_disk).sum())
            self.hot.remove(drop)
            evicted += drop.shape[0]
        self.counters["evicted"] += evicted
        return evicted

    def _hot_fields(self) -> dict[str, np.ndarray]:
        return {name: array[: self.hot.size] for name, array in self.hot.fields.items()}

    def _use_chunks(self) -> Iterator[dict[str, np.ndarray] | np.ndarray]:
        yield self._hot_fields()
        for _, records in self._cold_chunks(_SCAN):
            yield records

    def _cold_chunks(self, chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, records) of the rows whose newest copy is on disk, at most `chunk_rows` at a time."""
        for ids, records in self.store.scan(chunk_rows):
            cold = self.hot.find(ids) < 0
            if cold.any():
                yield ids[cold], records[cold]

    # ---- checkpoints ------------------------------------------------------------------------
    def layout(self) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        """What a saved row holds, as EmbeddingTable.layout: "ids", "values", each optimizer state
        (and "row_step"), "last_seen" and "seen" when kept."""
        names = [name for name in self.record.names if name != "born"]
        return {"ids": (np.dtype(np.int64), ()), **{name: self._type(name) for name in names}}

    def _type(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        field = self.record.dtype[name]
        return np.dtype(field.base.newbyteorder("=")), field.shape

    def row_chunks(self, chunk_rows: int) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(first row, {array name: rows}) for consecutive chunks of `chunk_rows` rows (the last
        may have fewer), every array of `layout()` in each, as EmbeddingTable gives them: the rows
        on disk (in id order, read `chunk_rows` at a time), then those in memory. `size` rows in
        all, in an order that holds while the caller keeps the table still (holds the store's
        lock) until it is done with them; memory holds about two chunks at a time."""
        first = 0
        for chunk in _rechunked(self._saved_pieces(chunk_rows), chunk_rows):
            yield first, chunk
            first += chunk["ids"].shape[0]

    def begin_snapshot(self, slice_rows: int, budget_bytes: int) -> FrozenSnapshot:
        """A checkpoint's view of the rows: changes wait until it ends (see FrozenSnapshot)."""
        self.write_back.drain()
        self.snapshot = FrozenSnapshot(self.size, self.layout(), self.row_chunks(slice_rows))
        return self.snapshot

    def end_snapshot(self) -> None:
        self.snapshot = None

    def _saved_pieces(self, chunk_rows: int) -> Iterator[dict[str, np.ndarray]]:
        self.write_back.drain()  # every row on disk, or in memory: none on its way
        names = [name for name in self.layout() if name != "ids"]
        for ids, records in self._cold_chunks(chunk_rows):
            yield {"ids": ids, **{name: np.ascontiguousarray(records[name]) for name in names}}
        for lo in range(0, self.hot.size, chunk_rows):
            hi = min(lo + chunk_rows, self.hot.size)
            yield {"ids": self.hot.ids[lo:hi], **{name: self.hot.fields[name][lo:hi] for name in names}}

    def load_rows(self, ids: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        """Add saved rows (a restore, one chunk at a time), as EmbeddingTable.load_rows: into memory
        while there is room, the rest to disk. The ids must be distinct and not stored yet."""
        ids = np.ascontiguousarray(ids, np.int64)
        self.write_back.drain()  # rows go to the store directly here
        if count_distinct(ids) != ids.shape[0] or self._stored(ids).any():
            raise InvalidArgumentError(f"table {self.name!r}: saved rows name an id twice")
        for lo in range(0, ids.shape[0], _BATCH):
            part = ids[lo : lo + _BATCH]
            fields = {name: array[lo : lo + _BATCH] for name, array in arrays.items() if name in self.record.names}
            records = self.record.from_arrays(part.shape[0], fields)
            if self.tracks_use:
                records["born"] = np.arange(self._born, self._born + part.shape[0])
            self._born += part.shape[0]
            room = min(self.hot.free, part.shape[0])
            self.hot.add(part[:room], records[:room], self._clock, on_disk=False)
            self.store.put(part[room:], records[room:])
            self._memory_only += room
            self._spilled += part.shape[0] - room

    def _stored(self, ids: np.ndarray) -> np.ndarray:
        stored = self.hot.find(ids) >= 0
        stored[~stored] = self.store.contains(ids[~stored])
        return stored

    def restore_meta(self, counters: dict[str, int], steps: int) -> None:
        """Set the counters and update count a checkpoint saved (after its rows are loaded)."""
        self.counters.update({key: int(counters.get(key, 0)) for key in self.counters})
        self.steps = int(steps)

    # ---- reporting and closing --------------------------------------------------------------
    def describe(self) -> dict:
        """As EmbeddingTable.describe ("bytes": the memory tier at its capacity), and the tiers."""
        return {
            "rows": self.size,
            "dim": self.dim,
            "updates": self.steps,
            **self.counters,
            "bytes": self.hot.nbytes,
            "memory_rows": self.hot.size,
            "memory_capacity": self.hot.capacity,
            "disk_rows": self._spilled,
            "disk_bytes": self.store.disk_bytes(),
            "disk_reads": self.store.reads,
            "disk_writes": self.store.writes,
            "write_back_rows": self.write_back.rows,
            **self._spill_state(),
        }

    def _spill_state(self) -> dict[str, str]:
        """The spill store's state when it is not "ok" ("full", "failed") and its cause."""
        condition = self.store.condition
        return {} if condition.state == OK else {"spill_state": condition.state, "spill_error": condition.cause}

    def close(self, delete: bool = True) -> None:
        """Stop the writer, close the store and (with `delete`) delete its files (the table is
        not used again; rows still queued are dropped with it). Never raises."""
        self.write_back.close()
        self.store.close(delete)


def _rechunked(pieces: Iterator[dict[str, np.ndarray]], chunk_rows: int) -> Iterator[dict[str, np.ndarray]]:
    """The rows of `pieces` (dicts of arrays of equal length) regrouped in chunks of `chunk_rows`
    (the last may have fewer); a piece that is a whole chunk passes as it is (no copy)."""
    held: list[dict[str, np.ndarray]] = []
    count = 0
    for piece in pieces:
        at, rows = 0, piece["ids"].shape[0]
        while at < rows:
            take = min(chunk_rows - count, rows - at)
            held.append(piece if take == rows else {name: array[at : at + take] for name, array in piece.items()})
            count, at = count + take, at + take
            if count == chunk_rows:
                yield _joined(held)
                held, count = [], 0
    if held:
        yield _joined(held)


def _joined(pieces: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if len(pieces) == 1:
        return pieces[0]
    return {name: np.concatenate([piece[name] for piece in pieces]) for name in pieces[0]}
