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
seconds at tens of millions of ids. Once the index is 3/8 full (`GROW_AT`) the next array
(twice the slots, zero pages) is mapped, and from then on each insert moves a share of the old
slots over, in order from an empty slot (`_start`), sized to end the move when 1/_SLACK of the
ids there is room for (up to `_MAX_LOAD` of the old array) have come; each `find` moves one
slot per id too, so a table only read ends it as well. Each stretch moved ends just before an
empty slot, so a run of occupied slots (the way a probe goes) moves whole: an id whose home, in
the old array, lies in the moved part is in the new array, any other in the old one (inserts
too), except where its probe of the old array runs into `_start` (kept empty while growing: the
only way from the part not moved into the moved part), then in the new one. `find` looks where
that rule says, one probe for almost every id.

The new array's pages are faulted in (`reserved.populate`, in order) just ahead of the moved
part, where its ids land: the two new slots of an old home h are h and h + old capacity. Fresh
pages written at random places would each stop on a page fault: a batch of 65,536 ids would
wait on tens of thousands of them (on a virtual machine a first touch of memory can cost 10 us
a page), and a read of one stops too (a zero page mapped). Moved old slots are zeroed and their
pages handed back once wholly moved (both arrays ask for 2 MiB pages: a probe lands at random, and
4 KiB pages missed the TLB at nearly every probe; handing back part of one would split it), so the
two arrays together never hold more than the new one's size, give or take a page: 16
bytes a slot, 43 to 49 bytes an id at any time. (Faulting the whole new array in before moving
any slot, the simpler order, holds three times the old array at the switch: up to 73 bytes an
id, a table of dim 16 with Adagrad past 1.5x its rows' own bytes.)

Only a batch larger than the room left (past `_MAX_LOAD`) finishes a growth at once. `items`,
`size` and `nbytes` count both arrays while a growth is under way.

Not thread-safe, `find` included (it moves slots): the owning table serializes calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from paramserver.base import kernels
from paramserver.base.hashing import mix64
from paramserver.tables import reserved

GROW_AT = 3 / 8  # load at which a growth starts
_MAX_LOAD = 11 / 16  # load past which an insert finishes a growth at once (a batch outrunning it)
_SLACK = 1.1  # a growth's shares are sized to end it when 1/_SLACK of its room is used
# Tests set these three small (a test seam) so that small indexes go through many calls of a growth.
_SHARE_MIN = 1 << 12  # old slots moved per call however few its ids
_AHEAD = 1 << 12  # old homes past the moved part whose new slots are faulted in already
_RESERVE_FROM = 1 << 16  # slots from which an array is mapped (and hands moved pages back) rather than np.zeros


@dataclass(frozen=True)
class Growth:
    """A growth under way, to look at (HashIndex.growth): the `old` and `new` slot arrays (views
    of the index's own: not to be written), `start` (the old slot the move began at, kept empty)
    and `moved` (old slots moved so far, counted from `start`)."""

    old: np.ndarray
    new: np.ndarray
    start: int
    moved: int


class HashIndex:
    """Maps each stored id to its row number (0, 1, 2, ... in insertion order)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._slots = _empty(1 << max(4, int(capacity - 1).bit_length()), faulted=True)
        self._next: np.ndarray | None = None  # the array a growth moves ids to, or None
        self._start = 0  # the old slot the move began at: empty, and kept empty while growing
        self._moved = 0  # old slots moved so far, counted from _start
        self._faulted = 0  # old homes, counted from _start, whose slots in the next array are faulted in
        self._released = 0  # old slots, counted from _start, whose whole pages were handed back
        self.size = 0

    @classmethod
    def holding(cls, ids: int) -> HashIndex:
        """An empty index that takes `ids` ids before it starts to grow (for a batch known up front)."""
        return cls(max(16, math.ceil(ids / GROW_AT)))

    @property
    def capacity(self) -> int:
        """Slots of the array the ids live in (of the one they are moving to, while growing)."""
        return (self._slots if self._next is None else self._next).shape[0]

    @property
    def growing(self) -> bool:
        """Whether a growth is moving ids to a larger array."""
        return self._next is not None

    @property
    def slots(self) -> np.ndarray:
        """The slot array ids are found in, (id, row + 1) pairs (while growing, the old one: see
        `growth`); a view of the index's own, to look at, not to write."""
        return self._slots

    @property
    def growth(self) -> Growth | None:
        """The growth under way, or None."""
        if self._next is None:
            return None
        return Growth(self._slots, self._next, self._start, self._moved)

    @property
    def nbytes(self) -> int:
        """Bytes the slot arrays hold: of a growth's old array what is not handed back yet, of
        its new one what is faulted in (where they are reserved; an ordinary array holds all)."""
        if self._next is None:
            return self._slots.nbytes
        old, new = self._slots, self._next
        left = old.shape[0] - self._moved if reserved.is_reserved(old) else old.shape[0]
        faulted = new.shape[0] * self._faulted // old.shape[0] if reserved.is_reserved(new) else new.shape[0]
        return (left + faulted) * old.strides[0]

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Row of each id, or -1 where the id is not stored."""
        return self.find_counted(ids)[0]

    def find_counted(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """`find`, and how many ids are not stored (counted by the same pass where it can)."""
        ids = np.ascontiguousarray(ids, np.int64)
        if self._next is None:
            return _find_counted(self._slots, ids)
        self._advance(max(_SHARE_MIN, ids.shape[0]))
        if self._next is None:
            return _find_counted(self._slots, ids)
        found = _find_growing(self._slots, self._start, self._moved, self._next, ids)
        return found, int(np.count_nonzero(found < 0))

    def find_still(self, ids: np.ndarray) -> np.ndarray:
        """What `find` answers, without moving any slot of a growth under way (`find` moves a share
        each call): a read that leaves the index as it is."""
        ids = np.ascontiguousarray(ids, np.int64)
        if self._next is None:
            return _find(self._slots, ids)
        return _find_growing(self._slots, self._start, self._moved, self._next, ids)

    def insert(self, ids: np.ndarray) -> np.ndarray:
        """Store ids that are absent and distinct; returns their new rows (size, size+1, ...)."""
        new_rows = np.arange(self.size, self.size + np.shape(ids)[0], dtype=np.int64)
        self.place(ids, new_rows)
        return new_rows

    def place(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Store ids that are absent and distinct with the given rows (the caller keeps rows unique:
        a table that renumbers rows after `remove`)."""
        ids, rows = np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(rows, np.int64)
        self._grow_share(ids.shape[0])
        if self.size + ids.shape[0] > _MAX_LOAD * self._slots.shape[0]:
            self._grow_now(self.size + ids.shape[0])
        if self._next is None:
            _place(self._slots, ids, rows)
        else:
            _place_growing(self._slots, self._start, self._moved, self._next, ids, rows)
        self.size += ids.shape[0]

    def remove(self, ids: np.ndarray) -> None:
        """Forget these ids (absent ones are skipped); the rows of the others do not change. A growth
        under way is finished first. Without the C kernels the index is rebuilt without them."""
        ids = np.ascontiguousarray(ids, np.int64)
        if self._next is not None:
            self._advance(self._slots.shape[0])
        if kernels.KERNELS is not None:
            removed = kernels.KERNELS.ps_index_remove(
                kernels.ptr(self._slots), self._slots.shape[0], kernels.ptr(ids), ids.shape[0]
            )
            self.size -= removed
            return
        keys, rows = self.items()
        kept = ~np.isin(keys, ids)
        self._slots[:] = 0
        _place(self._slots, np.ascontiguousarray(keys[kept]), np.ascontiguousarray(rows[kept]))
        self.size = int(kept.sum())

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """All stored (ids, rows), ordered by row."""
        arrays = [self._slots] if self._next is None else [self._slots, self._next]
        used = [array[array[:, 1] != 0] for array in arrays]
        keys = np.concatenate([slots[:, 0] for slots in used])
        rows = np.concatenate([slots[:, 1] for slots in used]) - 1
        order = np.argsort(rows)
        return keys[order], rows[order]

    def _grow_share(self, ids: int) -> None:
        """This insert's share of a growth (starting one at `GROW_AT` load): the old slots left
        to move, for its ids' part of the room left before `_MAX_LOAD`."""
        old = self._slots.shape[0]
        if self._next is None:
            if self.size + ids <= GROW_AT * old:
                return
            self._begin(2 * old)
        self._advance(_share(old - self._moved, ids, _MAX_LOAD * old - self.size))

    def _begin(self, capacity: int) -> None:
        """Start a growth into `capacity` slots (zero pages: faulted in as the move goes)."""
        self._next = _empty(capacity)
        self._start, self._moved, self._faulted, self._released = _first_empty(self._slots), 0, 0, 0

    def _grow_now(self, needed: int) -> None:
        """Room for `needed` ids at once: only a batch larger than the room a growth leaves
        (then a stall as long as the index, as a restore or compaction of that size takes anyway)."""
        while needed > _MAX_LOAD * self._slots.shape[0]:
            if self._next is None:
                capacity = 2 * self._slots.shape[0]
                while needed > GROW_AT * capacity:
                    capacity *= 2
                self._begin(capacity)
            self._advance(self._slots.shape[0])

    def _advance(self, count: int) -> None:
        """Move at least `count` more old slots, up to an empty one, faulting in the new slots
        of their homes (and `_AHEAD` more) first; the last share swaps the arrays."""
        old, new = self._slots, self._next
        if new is None:
            return
        total = old.shape[0]
        end = min(total, self._moved + count)
        while end < total and old[(self._start + end) % total, 1] != 0:
            end += 1  # a run of occupied slots moves whole
        self._fault(old, new, total if end == total else min(total, end + _AHEAD))
        for lo, hi in _segments(self._start, self._moved, end, total):
            _move_slots(old, lo, hi, new)
        self._hand_back(old, end)
        self._moved = end
        if end == total:
            self._slots, self._next = new, None

    def _hand_back(self, old: np.ndarray, end: int) -> None:
        """Hand back the whole huge pages of moved (zeroed) old slots [_released, end), counted
        from _start. A page moved in part waits for a later share: handing back part of a huge
        page splits it, which cost more than the move (skewed ids, 50M rows: docs/benchmarks/scale.md)."""
        for lo, hi in _segments(self._start, self._released, end, old.shape[0]):
            reserved.hand_back(old, lo, hi, reserved.HUGE_PAGE)
        # the slots of a page cut at `end` come again next time (a page handed back twice costs nothing)
        self._released = max(self._released, end - reserved.HUGE_PAGE // old.strides[0])

    def _fault(self, old: np.ndarray, new: np.ndarray, end: int) -> None:
        """Fault in the new slots of old homes [_faulted, end) (counted from _start)."""
        total = old.shape[0]
        if new.shape[0] != 2 * total:  # a growth at once by more than twice (_grow_now): all of it
            if self._faulted < total:
                reserved.populate(new, 0, new.shape[0])
            self._faulted = total
            return
        for lo, hi in _segments(self._start, self._faulted, end, total):
            reserved.populate(new, lo, hi)
            reserved.populate(new, total + lo, total + hi)
        self._faulted = max(self._faulted, end)


def _segments(start: int, lo: int, hi: int, total: int) -> list[tuple[int, int]]:
    """Slots [lo, hi) counted from `start` (wrapping around at `total`), as plain ranges."""
    if hi <= lo:
        return []
    a, b = start + lo, start + hi
    if b <= total:
        return [(a, b)]
    if a >= total:
        return [(a - total, b - total)]
    return [(a, total), (0, b - total)]


def _first_empty(slots: np.ndarray) -> int:
    """Position of an empty slot (an index at most 11/16 full has one within a few slots, w.h.p.)."""
    for lo in range(0, slots.shape[0], 1024):
        empty = np.flatnonzero(slots[lo : lo + 1024, 1] == 0)
        if empty.size:
            return lo + int(empty[0])
    raise RuntimeError("hash index slots full: it is kept at most 11/16 full")


def _share(left: int, ids: int, room: float) -> int:
    """Old slots to move now of `left`, for `ids` of the `room` ids a growth has: it ends at 1/_SLACK of the room."""
    return max(_SHARE_MIN, math.ceil(left * ids * _SLACK / max(room, 1.0)))


def _empty(capacity: int, faulted: bool = False) -> np.ndarray:
    """An empty (capacity x 2) int64 slot array: all zeros, no pass over it unless `faulted`
    (then its pages are faulted in now, in order, rather than one by one as ids land)."""
    # huge pages: probes land at random, and with 4 KiB pages nearly each one also missed the TLB
    # (docs/benchmarks/scale.md, "Rates at 50M rows"); `_hand_back` never splits one
    slots = reserved.reserve(capacity, (2,), np.int64, huge=True) if capacity >= _RESERVE_FROM else None
    if slots is None:
        slots = np.zeros((capacity, 2), np.int64)
    if faulted:
        reserved.populate(slots, 0, capacity)
    return slots


def _move_slots(old: np.ndarray, lo: int, hi: int, slots: np.ndarray) -> None:
    """Place the occupied slots of old[lo:hi] in `slots`, and zero them in `old`."""
    if kernels.KERNELS is not None:
        kernels.KERNELS.ps_index_move(kernels.ptr(old), lo, hi, kernels.ptr(slots), slots.shape[0])
        return
    block = old[lo:hi]
    used = block[block[:, 1] != 0]
    _place(slots, np.ascontiguousarray(used[:, 0]), used[:, 1] - 1)
    block[:] = 0


def _find(slots: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Row of each id (contiguous int64) in one slot array, or -1."""
    return _find_counted(slots, ids)[0]


def _find_counted(slots: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, int]:
    """`_find`, and how many of the ids are absent."""
    if kernels.KERNELS is None:
        found = _probe(slots, ids)[0]
        return found, int(np.count_nonzero(found < 0))
    found = np.empty(ids.shape[0], np.int64)
    missing = kernels.KERNELS.ps_index_find(
        kernels.ptr(slots), slots.shape[0], kernels.ptr(ids), ids.shape[0], kernels.ptr(found)
    )
    return found, int(missing)


def _find_growing(old: np.ndarray, start: int, moved: int, new: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Row of each id while a growth moves `old` to `new` (looked for where the module's rule says), or -1."""
    found = np.empty(ids.shape[0], np.int64)
    if kernels.KERNELS is not None:
        kernels.KERNELS.ps_index_find_growing(
            kernels.ptr(old), old.shape[0], start, moved, kernels.ptr(new), new.shape[0],
            kernels.ptr(ids), ids.shape[0], kernels.ptr(found),
        )  # fmt: skip
        return found
    in_new = _moved_home(old.shape[0], start, moved, ids)
    rest = np.flatnonzero(~in_new)
    found[rest], stop = _probe(old, ids[rest])
    in_new[rest[(found[rest] < 0) & (stop == start)]] = True
    found[in_new] = _probe(new, ids[in_new])[0]
    return found


def _place_growing(old: np.ndarray, start: int, moved: int, new: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    """Store absent, distinct ids with their rows while a growth moves `old` to `new` (where the module's rule says)."""
    if kernels.KERNELS is not None:
        kernels.KERNELS.ps_index_place_growing(
            kernels.ptr(old), old.shape[0], start, moved, kernels.ptr(new), new.shape[0],
            kernels.ptr(ids), kernels.ptr(rows), ids.shape[0],
        )  # fmt: skip
        return
    in_new = _moved_home(old.shape[0], start, moved, ids)
    rest = np.flatnonzero(~in_new)
    in_new[rest[_place_numpy(old, ids[rest], rows[rest], keep_empty=start)]] = True
    _place_numpy(new, ids[in_new], rows[in_new])


def _moved_home(total: int, start: int, moved: int, ids: np.ndarray) -> np.ndarray:
    """Whether each id's home in an old array of `total` slots lies in its moved part."""
    home = (mix64(ids) & np.uint64(total - 1)).astype(np.int64)
    return (home - start) % total < moved


def _probe(slots: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """numpy: (row of each id or -1, the slot its probe stopped at)."""
    capacity = slots.shape[0]
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
    return found, pos


def _place(slots: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> None:
    """Store absent, distinct ids with their rows in one slot array (kept at most `_MAX_LOAD` full)."""
    if kernels.KERNELS is None:
        _place_numpy(slots, ids, rows)
        return
    ids, rows = np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(rows, np.int64)
    kernels.KERNELS.ps_index_place(
        kernels.ptr(slots), slots.shape[0], kernels.ptr(ids), kernels.ptr(rows), ids.shape[0]
    )


def _place_numpy(slots: np.ndarray, ids: np.ndarray, rows: np.ndarray, keep_empty: int = -1) -> np.ndarray:
    """numpy `_place`, except ids whose probe reaches slot `keep_empty`: left out, their positions returned."""
    keys, stored = slots[:, 0], slots[:, 1]
    mask = slots.shape[0] - 1
    pos = (mix64(ids) & np.uint64(mask)).astype(np.int64)
    pending, turned = np.arange(ids.shape[0]), [np.zeros(0, np.int64)]
    while pending.size:
        at = pos[pending]
        free = stored[at] == 0
        stop = free & (at == keep_empty)
        turned.append(pending[stop])
        pending, at, free = pending[~stop], at[~stop], free[~stop]
        # of several ids probing the same free slot this round, the first takes it
        taken, first = np.unique(at[free], return_index=True)
        winners = pending[free][first]
        keys[taken] = ids[winners]
        stored[taken] = rows[winners] + 1
        placed = np.zeros(ids.shape[0], bool)
        placed[winners] = True
        pending = pending[~placed[pending]]
        pos[pending] = (pos[pending] + 1) & mask
    return np.concatenate(turned)
