"""Rows on their way from a tiered table's memory tier to disk: a bounded queue of slices, written
to the spill store by a thread of the table's own ("spill-write-<table>"), oldest slice first.

Why: writing a row to RocksDB costs 1.5-3 us of CPU; a request that made room by writing an eighth
of the memory tier itself stalled for seconds. Now a request that needs room moves the rows it
drops out of memory into a slice here (a numpy copy, in proportion to the rows dropped) and goes
on; the writer writes the slice and then forgets it. Until then the slice answers reads of its
rows (`find`: newest slice first, a binary search in each), so a row is always in memory, queued
or on disk, and the newest copy is found first.

Bounded: at most QUEUE_SLICES slices of `slice_rows` rows wait. A request that must queue rows
while the queue is full (the writer is behind: memory is truly full) waits for the writer to
finish a slice, within WAIT_S. Failures: the writer keeps a slice it could not write (its rows stay
readable here) and records the error. A full disk: the writer tries again every RETRY_S, or at
once when a request needs room; a request that needs room while the retry fails gets the
SpillError (full), as before. Any other failure (the store reported it to its SpillCondition, or
the writer itself broke) ends the writer; every later `check`, `put` or `drain` raises it.

Call order: made running; `close` stops the writer (the table's close). Thread-safety: `put`,
`find`, `drain`, `check` and `close` are the table's (its caller serializes them); the writer only
writes the oldest slice and then drops it, under the queue's lock.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass

import numpy as np

from paramserver.base.deadline import Deadline
from paramserver.tables.tiered.spill_store import WRITE_STALL_S, SpillError, SpillStore

log = logging.getLogger(__name__)

SLICE_ROWS = 1 << 15  # rows per slice: what one wait for the writer costs (about 0.1 s of writing)
QUEUE_SLICES = 4  # slices that may wait: the queue's memory is QUEUE_SLICES * SLICE_ROWS records
RETRY_S = 0.5  # a writer that found the disk full tries again after this
WAIT_S = WRITE_STALL_S + 10.0  # longest a request waits for the writer to move (a write's own bound, and some)


@dataclass
class _Slice:
    ids: np.ndarray  # sorted
    records: np.ndarray


class WriteBack:
    """The rows of one table queued for its spill store, and the thread that writes them."""

    def __init__(self, store: SpillStore, table: str, slice_rows: int = SLICE_ROWS) -> None:
        self.store = store
        self.slice_rows = max(1, slice_rows)
        self.max_rows = self.slice_rows * QUEUE_SLICES
        self._slices: collections.deque[_Slice] = collections.deque()
        self._rows = 0
        self._lock = threading.Lock()
        self._moved = threading.Condition(self._lock)  # a slice was written, or a write failed
        self._error: SpillError | None = None  # the last write's failure (None once one succeeds)
        self._tries = 0  # writes attempted: a request that asked for a retry waits for this to move
        self._retry = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=f"spill-write-{table}", daemon=True)
        self._thread.start()

    @property
    def rows(self) -> int:
        """Rows queued and not written yet."""
        return self._rows

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def put(self, ids: np.ndarray, records: np.ndarray) -> None:
        """Queue rows (distinct ids, at most `slice_rows`) to be written. Waits while the queue is
        full, for the writer to finish a slice; raises SpillError (nothing queued) when the writer
        cannot write."""
        if ids.shape[0] > self.slice_rows:
            raise ValueError(f"{ids.shape[0]} rows queued at once; a slice holds {self.slice_rows}")
        order = np.argsort(ids)
        piece = _Slice(ids[order], records[order])
        with self._moved:
            self._wait(lambda: not self._rows or self._rows + ids.shape[0] <= self.max_rows)
            self._slices.append(piece)
            self._rows += ids.shape[0]
            self._moved.notify_all()

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, records): whether each id is queued, and the newest queued record of those found, in order."""
        with self._lock:
            slices = list(self._slices)
        found = np.zeros(ids.shape[0], bool)
        if not slices:
            return found, np.zeros(0, self.store.record.dtype)
        records = np.zeros(ids.shape[0], self.store.record.dtype)
        for piece in reversed(slices):  # newest first: a row queued twice has its newest copy last
            left = np.flatnonzero(~found)
            at = np.minimum(np.searchsorted(piece.ids, ids[left]), piece.ids.shape[0] - 1)
            hit = piece.ids[at] == ids[left]
            records[left[hit]] = piece.records[at[hit]]
            found[left[hit]] = True
        return found, records[found]

    def drain(self) -> None:
        """Wait until every queued row is written (before the store is read or changed as a whole)."""
        with self._moved:
            self._wait(lambda: not self._rows)

    def check(self) -> None:
        """Raise the writer's failure when it cannot write any more (not for a full disk)."""
        error = self._error
        if error is not None and not error.full:
            raise SpillError(str(error), full=False) from error

    def close(self) -> None:
        """Stop the writer (rows not written are dropped: the store is closed and deleted next).
        Waits for a write in progress (bounded by the store's WRITE_STALL_S). Never raises."""
        with self._moved:
            self._closing = True
            self._moved.notify_all()
        self._thread.join(WAIT_S)
        if self._thread.is_alive():
            log.warning("spill store %s: its writer did not stop in %.0fs", self.store.path, WAIT_S)

    def _wait(self, done) -> None:
        """Wait (holding the lock) until `done()`: while the writer moves, within WAIT_S of its last move."""
        deadline, rows, asked = Deadline(WAIT_S), self._rows, None
        while not done():
            if self._error is not None:
                if not self._error.full or asked == self._tries - 1:  # failed for good, or the retry failed too
                    raise SpillError(str(self._error), full=self._error.full) from self._error
                if asked is None or self._tries > asked + 1:
                    asked, self._retry = self._tries, True  # a full disk: try again now
                    self._moved.notify_all()
            elif not self.running:
                raise SpillError(f"spill store {self.store.path}: its writer stopped")
            if self._rows < rows:
                deadline, rows = Deadline(WAIT_S), self._rows
            if deadline.passed():
                raise SpillError(f"spill store {self.store.path}: its writer wrote nothing for {WAIT_S:.0f}s")
            self._moved.wait(min(deadline.left(), RETRY_S))

    def _run(self) -> None:
        while True:
            piece = self._next()
            if piece is None:
                return
            try:
                self.store.put(piece.ids, piece.records)
            except SpillError as exc:
                if not self._failed(exc):
                    return
                continue
            except Exception as exc:  # a bug, or memory: the store is not trusted any more
                cause = f"spill store {self.store.path}: its writer failed: {exc!r}"
                log.exception("%s", cause)
                self.store.condition.fail(cause)
                self._failed(SpillError(cause))
                return
            with self._moved:
                self._slices.popleft()
                self._rows -= piece.ids.shape[0]
                self._error, self._tries = None, self._tries + 1
                self._moved.notify_all()

    def _next(self) -> _Slice | None:
        """The oldest slice once there is one to write (after RETRY_S, or a request's ask, when the
        last write failed); None once closing."""
        with self._moved:
            while not self._closing:
                if self._slices and self._error is None:
                    return self._slices[0]
                if self._error is not None and (self._retry or not self._moved.wait(RETRY_S)):
                    self._retry = False
                    return self._slices[0]
                if self._error is None:
                    self._moved.wait(RETRY_S)
            return None

    def _failed(self, exc: SpillError) -> bool:
        """Record a failed write; returns whether the writer goes on (a full disk)."""
        with self._moved:
            self._error, self._tries = exc, self._tries + 1
            self._moved.notify_all()
        return exc.full
