"""The operator's limits on what tables may take on one PS, checked before memory is taken.

A table's memory is its per-row arrays (values, each optimizer state, use counters) at their
logical capacity (`EmbeddingTable.capacity`: it grows 1.5x at a time, in place once the arrays
live in reserved address space, which costs memory only where rows are written), plus its hash
index; rows are created by lookups (and by a registration's capacity
reserved up front). Both the rows of one table and the bytes of all tables of the PS are
bounded (`Options.max_table_rows`, `Options.max_table_memory_bytes`); a request that would pass
either is refused with ResourceExhaustedError and changes nothing.

Each refusal names the limit, its value, and how to raise it (`raise_hint`: the flag and the
option). A PS derives the two from its machine's memory when they are left at 0
(base/options/machine.py, `Options.for_machine`, once at start); a TableLimits given 0 derives them
the same way when built. A TableStore built without limits (tools, tests) takes the fixed ones below.

A tiered table (a PS with a table_memory_budget; docs/scaling.md) counts its memory tier, which its
share of the budget bounds, against max_table_memory_bytes, and all its rows, memory and disk,
against `Options.max_tiered_table_rows` instead of max_table_rows: its rows are meant to outgrow
memory. Its rows a lookup may create are bounded by the ids not in memory (those on disk are not
looked up twice to tell them from new ones).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from paramserver.base.errors import ConfigError, ResourceExhaustedError
from paramserver.base.hashing import count_distinct
from paramserver.base.options.fields import flag_of
from paramserver.base.options.machine import DERIVED
from paramserver.base.options.options import Options
from paramserver.tables.embedding_table import EmbeddingTable
from paramserver.tables.table import Table
from paramserver.tables.tiered.tiered_table import TieredTable

_GROWTH = 1.5  # as EmbeddingTable grows its capacity
# the hash index: 16-byte slots, 2.7 to 3.1 for each row held (hash_index.py), which is about two
# for each row of capacity (the capacity being 1 to 1.5 times the rows held)
_INDEX_BYTES_PER_ROW = 2 * 2 * 8


@dataclass(frozen=True)
class TableLimits:
    """`max_rows`: rows one table may hold on this PS; `max_bytes`: bytes all its tables may hold
    (and, at registration, its dense variables with their optimizer state); `max_tiered_rows`: rows
    one tiered table may hold on this PS (memory and disk); `max_gradient`: the largest magnitude
    a pushed gradient value may have (larger ones are refused like NaN)."""

    max_rows: int = 1 << 27
    max_bytes: int = 16 << 30
    max_tiered_rows: int = 1 << 34
    max_gradient: float = 1e15

    def __post_init__(self) -> None:
        if min(self.max_rows, self.max_bytes) < 0:
            raise ConfigError(f"table limits must be 0 (derived) or more, got {self}")
        if self.max_rows == DERIVED or self.max_bytes == DERIVED:
            # a PS resolves them once at start (Options.for_machine); limits built straight from
            # options left at 0 are derived here, as there
            resolved = Options(max_table_rows=self.max_rows, max_table_memory_bytes=self.max_bytes).for_machine()
            object.__setattr__(self, "max_rows", resolved.max_table_rows)
            object.__setattr__(self, "max_bytes", resolved.max_table_memory_bytes)


def raise_hint(option: str) -> str:
    """How to raise the limit `option` (an Options field): its flag and its option name."""
    flags = {f.name: flag_of(f) for f in fields(Options)}
    flag = flags[option]
    via = f"{flag.name} (paramserver run / node) or " if flag is not None else ""
    return f"raise it with {via}the option {option} (a cluster file's options or PARAMSERVER_OPTIONS)"


def row_bytes(dim: int, float_states: int, per_row_step: bool, tracks_use: bool) -> int:
    """Bytes one row of capacity costs: values and optimizer state, its id, row step, use counters,
    the epoch of its last change (4: incremental checkpoints)."""
    return 4 * dim * (1 + float_states) + 8 + 8 * per_row_step + 16 * tracks_use + 4 + _INDEX_BYTES_PER_ROW


def table_row_bytes(table: EmbeddingTable) -> int:
    states = sum(1 for key in table.state if key != "row_step")
    return row_bytes(table.dim, states, "row_step" in table.state, table.tracks_use)


def table_bytes(table: Table) -> int:
    """What the table holds now: its arrays at capacity (capacity is what memory was taken for);
    of a tiered table, its memory tier."""
    if isinstance(table, TieredTable):
        return table.hot.nbytes
    in_memory = _in_memory(table)
    return in_memory.capacity * table_row_bytes(in_memory)


def _in_memory(table: Table) -> EmbeddingTable:
    """A table that is not tiered: the other kind (table.py)."""
    if not isinstance(table, EmbeddingTable):
        raise TypeError(f"table {table.name!r}: no limits for a {type(table).__name__}")
    return table


def check_new_table(
    limits: TableLimits, name: str, capacity: int, one_row: int, used: int, tiered: bool = False
) -> None:
    """Raise unless a table of `capacity` rows (`one_row` bytes each) fits next to `used` bytes.
    A tiered table's memory comes from the PS's budget: only its rows are checked."""
    if tiered:
        if capacity > limits.max_tiered_rows:
            raise ResourceExhaustedError(
                f"table {name!r}: capacity {capacity} exceeds the PS's max_tiered_table_rows {limits.max_tiered_rows}; "
                f"{raise_hint('max_tiered_table_rows')}"
            )
        return
    if capacity > limits.max_rows:
        raise ResourceExhaustedError(
            f"table {name!r}: capacity {capacity} exceeds the PS's max_table_rows {limits.max_rows}; "
            f"{raise_hint('max_table_rows')}"
        )
    if used + capacity * one_row > limits.max_bytes:
        raise ResourceExhaustedError(
            f"table {name!r}: {capacity} rows of {one_row} bytes would bring the PS's "
            f"tables to {used + capacity * one_row} bytes, over max_table_memory_bytes "
            f"{limits.max_bytes}; {raise_hint('max_table_memory_bytes')}"
        )


def check_new_rows(limits: TableLimits, table: Table, ids: np.ndarray, used: int) -> None:
    """Raise unless the rows a lookup of `ids` may create fit (every missing id counted as admitted:
    the policy may admit any of them). `used`: bytes of all the PS's tables now."""
    if isinstance(table, TieredTable):
        _check_tiered_rows(limits, table, ids)
        return
    _check_rows(limits, _in_memory(table), ids, used)


def _check_rows(limits: TableLimits, table: EmbeddingTable, ids: np.ndarray, used: int) -> None:
    """An in-memory table's lookup: its new rows, and the memory its arrays grow by to hold them."""
    if table.size + ids.shape[0] <= min(table.capacity, limits.max_rows):  # fits even if every id is new
        return
    missing = count_distinct(ids[table.index.find(ids) < 0])
    if not missing:
        return
    rows = table.size + missing
    if rows > limits.max_rows:
        raise ResourceExhaustedError(
            f"table {table.name!r}: {missing} new rows would bring it to {rows} rows, "
            f"over the PS's max_table_rows {limits.max_rows}; {raise_hint('max_table_rows')}"
        )
    capacity = table.capacity
    if rows <= capacity:
        return
    grown = max(rows, int(capacity * _GROWTH)) - capacity
    extra = grown * table_row_bytes(table)
    if used + extra > limits.max_bytes:
        raise ResourceExhaustedError(
            f"table {table.name!r}: {missing} new rows would grow the PS's tables to "
            f"{used + extra} bytes, over max_table_memory_bytes {limits.max_bytes}; "
            f"{raise_hint('max_table_memory_bytes')}"
        )


def _check_tiered_rows(limits: TableLimits, table: TieredTable, ids: np.ndarray) -> None:
    """A tiered table's lookup: its new rows go to disk when memory is full, so only rows count,
    every id not in memory as a new one."""
    if table.size + ids.shape[0] <= limits.max_tiered_rows:  # fits even if every id is new: no look-up
        return
    missing = count_distinct(ids[table.hot.find(ids) < 0])
    if missing and table.size + missing > limits.max_tiered_rows:
        raise ResourceExhaustedError(
            f"table {table.name!r}: up to {missing} new rows would bring it to {table.size + missing} rows, "
            f"over the PS's max_tiered_table_rows {limits.max_tiered_rows}; {raise_hint('max_tiered_table_rows')}"
        )
