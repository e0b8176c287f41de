"""A vectorized hash index from int64 ids to row numbers.

Open addressing with linear probing over one array of (key, row) slots, kept at most half
full (a probe reads one cache line); every operation works on a whole batch of ids at once (a probe round per collision
depth, not a Python loop per id), so memory per id stays at a few bytes and there is no
Python object per id. With the C kernels built, find and place are one compiled loop
instead (the same ids found; colliding ids may take other slots). Not thread-safe: the owning table serializes calls.
"""

from __future__ import annotations

import numpy as np

from ..base import kernels
from ..base.hashing import empty_slots, mix64


class HashIndex:
    """Maps each stored id to its row number (0, 1, 2, ... in insertion order)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._set_slots(1 << max(4, int(capacity - 1).bit_length()))
        self.size = 0

    def _set_slots(self, capacity: int) -> None:
        self._slots = empty_slots(capacity)
        self._keys, self._rows = self._slots[:, 0], self._slots[:, 1]  # views

    @property
    def capacity(self) -> int:
        return self._slots.shape[0]

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Row of each id, or -1 where the id is not stored."""
        ids = np.ascontiguousarray(ids, np.int64)
        if kernels.KERNELS is not None:
            found = np.empty(ids.shape[0], np.int64)
            kernels.KERNELS.ps_index_find(
                kernels.ptr(self._slots), self.capacity, kernels.ptr(ids), ids.shape[0], kernels.ptr(found)
            )
            return found
        mask = np.uint64(self.capacity - 1)
        pos = (mix64(ids) & mask).astype(np.int64)
        found = np.full(ids.shape[0], -1, np.int64)
        active = np.arange(ids.shape[0])
        while active.size:
            slots = pos[active]
            rows, keys = self._rows[slots], self._keys[slots]
            hit = (rows >= 0) & (keys == ids[active])
            found[active[hit]] = rows[hit]
            active = active[~(hit | (rows < 0))]
            pos[active] = (pos[active] + 1) & (self.capacity - 1)
        return found

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Store ids that are absent and distinct; returns their new rows (size, size+1, ...)."""
        ids = np.asarray(ids, np.int64)
        if 2 * (self.size + ids.shape[0]) > self.capacity:
            self._grow(self.size + ids.shape[0])
        new_rows = np.arange(self.size, self.size + ids.shape[0], dtype=np.int64)
        self._place(ids, new_rows)
        self.size += ids.shape[0]
        return new_rows

    def _place(self, ids: np.ndarray, rows: np.ndarray) -> None:
        if kernels.KERNELS is not None:
            ids, rows = np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(rows, np.int64)
            kernels.KERNELS.ps_index_place(
                kernels.ptr(self._slots), self.capacity, kernels.ptr(ids), kernels.ptr(rows), ids.shape[0]
            )
            return
        mask = self.capacity - 1
        pos = (mix64(ids) & np.uint64(mask)).astype(np.int64)
        pending = np.arange(ids.shape[0])
        while pending.size:
            slots = pos[pending]
            free = self._rows[slots] < 0
            # of several ids probing the same free slot this round, the first takes it
            taken, first = np.unique(slots[free], return_index=True)
            winners = pending[free][first]
            self._keys[taken] = ids[winners]
            self._rows[taken] = rows[winners]
            placed = np.zeros(ids.shape[0], bool)
            placed[winners] = True
            pending = pending[~placed[pending]]
            pos[pending] = (pos[pending] + 1) & mask

    def _grow(self, needed: int) -> None:
        used = self._rows >= 0
        keys, rows = self._keys[used], self._rows[used]
        capacity = self.capacity
        while 2 * needed > capacity:
            capacity *= 2
        self._set_slots(capacity)
        self._place(keys, rows)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All stored (ids, rows), ordered by row."""
        used = self._rows >= 0
        order = np.argsort(self._rows[used])
        return self._keys[used][order], self._rows[used][order]
