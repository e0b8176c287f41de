"""A table's rows as they were at one instant, read a slice at a time while training goes on.

How a checkpoint saves a table without copying it (and without stopping training for the whole
write): when the snapshot begins, the table's rows are 0..size-1 (row order). A writer then takes
one slice of rows at a time (`next_slice`: a copy of a few MB, under the table's lock: a brief
pause), and writes it with no lock held. Until the writer has passed a row, any change to it
first keeps the row's old contents aside (`preserve`, called by the table before it changes
rows: copy-on-write per row), and the slice is patched with them. Rows created after the
snapshot began are not part of it; eviction (which moves rows) waits until it ends.

Memory: the slice being copied, plus the rows kept aside: at most the rows changed during the
write, each once. `over_budget` tells the store when they pass `budget_bytes`, so that it holds
further changes until the writer has moved on (see TableStore).

A delta (`since`: an earlier snapshot's epoch) holds only the rows stamped after it in the
table's ``changed`` array (embedding_table.py), which is kept aside with the rest of a row, so
the rows a slice keeps are those changed as at the start; `rows` (what the file holds) is
counted when it begins, a block of stamps at a time. `deleted`: the ids evicted since (a delta's).

Not thread-safe: the owning TableStore's lock of the table serializes every call.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class RowSnapshot:
    """Rows 0..size-1 of one table (each array of its `layout`) as they were at the start."""

    holds_changes = False  # changes go on; the rows they change are kept aside

    def __init__(
        self,
        size: int,
        layout: dict[str, tuple[np.dtype, tuple[int, ...]]],
        array: Callable[[str], np.ndarray],
        slice_rows: int,
        budget_bytes: int,
        since: int | None = None,
        deleted: np.ndarray | None = None,
    ) -> None:
        self.size, self.layout, self.slice_rows, self.budget_bytes = size, layout, slice_rows, budget_bytes
        self._array = array  # the table's live array of a name (looked up each time: growth replaces arrays)
        self.since = since
        self.deleted = deleted if deleted is not None else np.zeros(0, np.int64)
        self._names = [*layout, "changed"] if since is not None else list(layout)  # what a change keeps aside
        self.rows = size if since is None else _count_changed(array("changed"), size, since, slice_rows)
        self._written = 0  # rows of the file handed to the writer
        self.cursor = 0  # rows below were handed to the writer
        self._kept = np.zeros(size, bool)  # rows whose old contents are kept aside
        self._aside: dict[int, list[tuple[np.ndarray, dict[str, np.ndarray]]]] = {}  # by slice number
        self.kept_bytes = 0
        self.peak_kept_bytes = 0

    @property
    def done(self) -> bool:
        return self.cursor >= self.size

    @property
    def over_budget(self) -> bool:
        return self.kept_bytes > self.budget_bytes and not self.done

    def preserve(self, rows: np.ndarray) -> None:
        """Keep the current contents of `rows` aside if the writer still needs them (call before
        changing them; repeated rows are fine)."""
        rows = rows[(rows >= self.cursor) & (rows < self.size)]
        if rows.size == 0:
            return
        rows = np.unique(rows[~self._kept[rows]])
        if rows.size == 0:
            return
        self._kept[rows] = True
        slices = rows // self.slice_rows
        for number in np.unique(slices):
            mine = rows[slices == number]
            saved = {name: self._array(name)[mine] for name in self._names}
            self._aside.setdefault(int(number), []).append((mine, saved))
            self.kept_bytes += sum(array.nbytes for array in saved.values())
        self.peak_kept_bytes = max(self.peak_kept_bytes, self.kept_bytes)

    def next_slice(self) -> tuple[int, dict[str, np.ndarray]] | None:
        """(first row in the file, {array name: rows}) of the next slice, as at the start (a delta's:
        the rows changed since, possibly none); None when done."""
        if self.done:
            return None
        lo = self.cursor
        hi = min(lo + self.slice_rows, self.size)
        aside = self._aside.pop(lo // self.slice_rows, [])
        self.kept_bytes -= sum(array.nbytes for _, saved in aside for array in saved.values())
        self.cursor = hi
        at = self._written
        if self.since is not None:
            arrays = self._changed_rows(lo, hi, aside)
            self._written += len(arrays["ids"])
            return at, arrays
        arrays = {name: self._array(name)[lo:hi].copy() for name in self._names}
        for rows, saved in aside:
            for name, array in arrays.items():
                array[rows - lo] = saved[name]
        self._written += hi - lo
        return at, arrays

    def _changed_rows(self, lo: int, hi: int, aside: list) -> dict[str, np.ndarray]:
        """A delta's slice: the rows of lo..hi whose epoch at the start is after `since` (the
        stamps are read first, so only those rows are copied)."""
        stamps = self._array("changed")[lo:hi].copy()
        for rows, saved in aside:
            stamps[rows - lo] = saved["changed"]
        picked = np.flatnonzero(stamps > self.since)
        arrays = {name: self._array(name)[lo + picked] for name in self.layout}
        for rows, saved in aside:  # rows changed since the start: their contents as at the start
            at = np.minimum(np.searchsorted(picked, rows - lo), max(picked.shape[0] - 1, 0))
            hit = (picked[at] == rows - lo) if picked.shape[0] else np.zeros(rows.shape[0], bool)
            for name, array in arrays.items():
                array[at[hit]] = saved[name][hit]
        return arrays


def _count_changed(changed: np.ndarray, size: int, since: int, block: int) -> int:
    """Rows among 0..size-1 stamped after epoch `since`, a block at a time (no table-sized temporary)."""
    block = max(block, 1 << 16)
    return sum(int(np.count_nonzero(changed[lo : min(lo + block, size)] > since)) for lo in range(0, size, block))


class FrozenSnapshot:
    """A snapshot of a table that cannot keep rows aside (a tiered table: its rows move between
    memory and disk): changes wait until the writer is done (`holds_changes`), so the rows it
    reads a slice at a time (`slices`: the table's row_chunks) are those of the start."""

    holds_changes = True
    kept_bytes = 0
    peak_kept_bytes = 0

    since = None  # always whole (a tiered table keeps no change stamps)
    deleted = np.zeros(0, np.int64)

    def __init__(self, size: int, layout: dict, slices) -> None:
        self.size, self.rows, self.layout = size, size, layout
        self._slices = slices
        self.done = size == 0

    @property
    def over_budget(self) -> bool:
        return not self.done

    def next_slice(self) -> tuple[int, dict[str, np.ndarray]] | None:
        taken = next(self._slices, None)
        if taken is None:
            self.done = True
        return taken
