"""A vectorized hash index from int64 ids to row numbers, that grows without a pause.

Open addressing with linear probing over one array of (key, row + 1) slots, kept at most 11/16
full and mostly under 3/8 (a probe reads one or two cache lines); every operation works on a
whole batch of ids at once (a probe round per collision depth, not a Python loop per id), so
memory per id stays at a few bytes and there is no Python object per id. With the C kernels
built, find and place are one compiled loop instead (the same ids found; colliding ids may take
other slots).

A slot stores row + 1, so 0 marks an empty slot: a fresh array of zeros (np.zeros, or pages of a
`reserved` mapping the kernel has not handed out yet) is an empty index with no fill pass.

Growth is incremental, as Redis rehashes: rehashing every slot at once stalled a lookup for
seconds at tens of millions of ids. It has two phases, each done a share per call, sized to end
the phase when 1/_SLACK of the ids it has room for have come (at least `_SHARE_MIN` slots):
1. Fault in. Once the index is 3/8 full (`_GROW_AT`), the next array (twice the slots) is mapped
   and its pages are faulted in, in order, by the inserts, before the old one is `_MAX_LOAD` full.
   Fresh pages written at random places would each stop on a page fault: a batch of 65,536 ids
   would wait on tens of thousands of them (and on a virtual machine a first touch of memory
   can cost 10 us a page).
2. Move. The faulted array takes the inserts, and each insert moves a share of the old slots
   over, sized to end before the new array is `_GROW_AT` full (each `find` moves one slot per
   id too, so a table only read finishes the move). `find` looks in the new array first, then in
   the old one for the misses. The old array is walked from its first slot on, and every
   stretch moved ends just before a slot that is empty: a run of occupied slots (the way a
   probe goes) never has a moved part followed by one still there, so a probe of the old array
   for an id still there passes no moved slot (moved slots are zeroed, their pages handed back).
Only a batch larger than the room left (past `_MAX_LOAD`) finishes a growth at once. `items`,
`size` and `nbytes` count every array while a growth is under way. Memory: 16 bytes a slot, so
43 to 49 bytes an id between growths; up to 73 at a growth's switch (the old array full and the
next one, twice its size, faulted in), shrinking as the old slots move out.

Not thread-safe, `find` included (it moves slots): the owning table serializes calls.
"""

from __future__ import annotations

import math

import numpy as np

from ..base import kernels
from ..base.hashing import mix64
from . import reserved

_GROW_AT = 3 / 8  # load at which a growth starts (faulting in the next slot array)
_MAX_LOAD = 11 / 16  # load past which an insert finishes a growth at once (a batch outrunning it)
_SLACK = 1.1  # a phase's shares are sized to end it when 1/_SLACK of its room is used
_SHARE_MIN = 1 << 12  # slots faulted in or moved per call however few its ids
_RESERVE_FROM = 1 << 16  # slots from which an array is mapped (and hands moved pages back) rather than np.zeros


class HashIndex:
    """Maps each stored id to its row number (0, 1, 2, ... in insertion order)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._slots = _empty(1 << max(4, int(capacity - 1).bit_length()), faulted=True)
        self._next: np.ndarray | None = None  # the array a growth is faulting in, or None
        self._faulted = 0  # its slots faulted in so far
        self._old: np.ndarray | None = None  # the slots a growth is moving out of, or None
        self._moved = 0  # old slots moved so far, from the first on
        self.size = 0

    @classmethod
    def holding(cls, ids: int) -> HashIndex:
        """An empty index that takes `ids` ids before it starts to grow (for a batch known up front)."""
        return cls(max(16, math.ceil(ids / _GROW_AT)))

    @property
    def capacity(self) -> int:
        return self._slots.shape[0]

    @property
    def growing(self) -> bool:
        """Whether a growth is under way (faulting in the next array, or moving slots to it)."""
        return self._next is not None or self._old is not None

    @property
    def nbytes(self) -> int:
        """Bytes the slot arrays hold: of the next one what is faulted in, of the old one what is
        not handed back yet (where they are reserved; an ordinary array holds all of it)."""
        total = self._slots.nbytes
        if self._next is not None:
            faulted = self._faulted if reserved.is_reserved(self._next) else self._next.shape[0]
            total += faulted * self._next.strides[0]
        if self._old is not None:
            left = self._old.shape[0] - self._moved if reserved.is_reserved(self._old) else self._old.shape[0]
            total += left * self._old.strides[0]
        return total

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Row of each id, or -1 where the id is not stored."""
        ids = np.ascontiguousarray(ids, np.int64)
        if self._old is not None:
            self._move(self._old, max(_SHARE_MIN, ids.shape[0]))
        found = _find(self._slots, ids)
        if self._old is not None:
            missed = np.flatnonzero(found < 0)
            if missed.size:
                found[missed] = _find(self._old, ids[missed])
        return found

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Store ids that are absent and distinct; returns their new rows (size, size+1, ...)."""
        ids = np.ascontiguousarray(ids, np.int64)
        self._grow_share(ids.shape[0])
        if self.size + ids.shape[0] > _MAX_LOAD * self.capacity:
            self._grow_now(self.size + ids.shape[0])
        new_rows = np.arange(self.size, self.size + ids.shape[0], dtype=np.int64)
        _place(self._slots, ids, new_rows)
        self.size += ids.shape[0]
        return new_rows

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All stored (ids, rows), ordered by row."""
        arrays = [self._slots] if self._old is None else [self._slots, self._old]
        used = [array[array[:, 1] != 0] for array in arrays]
        keys = np.concatenate([slots[:, 0] for slots in used])
        rows = np.concatenate([slots[:, 1] for slots in used]) - 1
        order = np.argsort(rows)
        return keys[order], rows[order]

    def _grow_share(self, ids: int) -> None:
        """This insert's share of a growth: start one at `_GROW_AT` load, fault in a share of
        the next array (its room: up to `_MAX_LOAD`), or move a share of the old slots (its
        room: up to `_GROW_AT` of the new array, when the next growth would start)."""
        if self._old is not None:
            room = _GROW_AT * self.capacity - self.size
            self._move(self._old, _share(self._old.shape[0] - self._moved, ids, room))
        elif self._next is not None or self.size + ids > _GROW_AT * self.capacity:
            if self._next is None:
                self._next, self._faulted = _empty(2 * self.capacity), 0
            room = _MAX_LOAD * self.capacity - self.size
            self._fault(self._next, _share(self._next.shape[0] - self._faulted, ids, room))

    def _fault(self, next_slots: np.ndarray, count: int) -> None:
        end = min(next_slots.shape[0], self._faulted + count)
        reserved.populate(next_slots, self._faulted, end)
        self._faulted = end
        if end == next_slots.shape[0]:  # faulted in: it takes the inserts, the old slots move over
            self._old, self._slots, self._next = self._slots, next_slots, None
            self._moved = 0

    def _grow_now(self, needed: int) -> None:
        """Room for `needed` ids at once: only a batch larger than the room a growth leaves
        (then a stall as long as the index, as a restore or compaction of that size takes anyway)."""
        self._finish()
        if needed > _MAX_LOAD * self.capacity:
            capacity = self.capacity
            while 2 * needed > capacity:
                capacity *= 2
            self._next, self._faulted = _empty(capacity), 0
            self._finish()

    def _finish(self) -> None:
        """End a growth under way at once."""
        if self._next is not None:
            self._fault(self._next, self._next.shape[0])
        if self._old is not None:
            self._move(self._old, self._old.shape[0])

    def _move(self, old: np.ndarray, count: int) -> None:
        """Move at least `count` more `old` slots, up to an empty one, into the new array."""
        lo, total = self._moved, old.shape[0]
        hi = min(total, lo + count)
        while hi < total and old[hi, 1] != 0:
            hi += 1  # a run of occupied slots moves whole
        _move_slots(old, lo, hi, self._slots)
        reserved.release(old, lo, hi)  # zero, and whole pages handed back
        self._moved = hi
        if hi == total:
            self._old = None


def _share(left: int, ids: int, room: float) -> int:
    """Slots to do now of `left`, for `ids` of the `room` ids the phase has: ends it at 1/_SLACK of the room."""
    return max(_SHARE_MIN, math.ceil(left * ids * _SLACK / max(room, 1.0)))


def _empty(capacity: int, faulted: bool = False) -> np.ndarray:
    """An empty (capacity x 2) int64 slot array: all zeros, no pass over it unless `faulted`
    (then its pages are faulted in now, in order, rather than one by one as ids land)."""
    slots = reserved.reserve(capacity, (2,), np.int64) if capacity >= _RESERVE_FROM else None
    if slots is None:
        slots = np.zeros((capacity, 2), np.int64)
    if faulted:
        reserved.populate(slots, 0, capacity)
    return slots


def _move_slots(old: np.ndarray, lo: int, hi: int, slots: np.ndarray) -> None:
    """Place the occupied slots of old[lo:hi] in `slots` (the C kernel zeroes them in `old` too)."""
    if kernels.KERNELS is not None:
        kernels.KERNELS.ps_index_move(kernels.ptr(old), lo, hi, kernels.ptr(slots), slots.shape[0])
        return
    block = old[lo:hi]
    used = block[block[:, 1] != 0]
    _place(slots, np.ascontiguousarray(used[:, 0]), used[:, 1] - 1)


def _find(slots: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Row of each id (contiguous int64) in one slot array, or -1."""
    capacity = slots.shape[0]
    if kernels.KERNELS is not None:
        found = np.empty(ids.shape[0], np.int64)
        kernels.KERNELS.ps_index_find(kernels.ptr(slots), capacity, kernels.ptr(ids), ids.shape[0], kernels.ptr(found))
        return found
    keys, stored = slots[:, 0], slots[:, 1]
    pos = (mix64(ids) & np.uint64(capacity - 1)).astype(np.int64)
    found = np.full(ids.shape[0], -1, np.int64)
    active = np.arange(ids.shape[0])
    while active.size:
        at = pos[active]
        held, key = stored[at], keys[at]
        hit = (held != 0) & (key == ids[active])
        found[active[hit]] = held[hit] - 1
        active = active[~(hit | (held == 0))]
        pos[active] = (pos[active] + 1) & (capacity - 1)
    return found


def _place(slots: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    """Store absent, distinct ids with their rows in one slot array (kept at most `_MAX_LOAD` full)."""
    capacity = slots.shape[0]
    if kernels.KERNELS is not None:
        ids, rows = np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(rows, np.int64)
        kernels.KERNELS.ps_index_place(kernels.ptr(slots), capacity, kernels.ptr(ids), kernels.ptr(rows), ids.shape[0])
        return
    keys, stored = slots[:, 0], slots[:, 1]
    mask = capacity - 1
    pos = (mix64(ids) & np.uint64(mask)).astype(np.int64)
    pending = np.arange(ids.shape[0])
    while pending.size:
        at = pos[pending]
        free = stored[at] == 0
        # of several ids probing the same free slot this round, the first takes it
        taken, first = np.unique(at[free], return_index=True)
        winners = pending[free][first]
        keys[taken] = ids[winners]
        stored[taken] = rows[winners] + 1
        placed = np.zeros(ids.shape[0], bool)
        placed[winners] = True
        pending = pending[~placed[pending]]
        pos[pending] = (pos[pending] + 1) & mask
