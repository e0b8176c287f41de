"""The embedding tables of a shard, and the checks every lookup and sparse push passes.

Rows are float32; a table's wire dtype (wire/half.py) is how its rows leave and its row gradients
arrive (bfloat16 or float16: half the bytes). Row pushes are applied when their shard's step
applies them (`apply_rows`): on arrival in async and ssp modes, averaged with the other workers'
of the same step in sync mode.

Thread-safe, and calls on different tables run in parallel: each table has its own lock (its
rows, index and snapshot), taken by every call on it; the store's lock guards which tables exist
and the checkpoint's snapshots. The table kernels (base/kernels.py) run without the GIL, so
request threads on different tables use different cores. Lock order: the store's lock before a
table's, and tables' locks in name order; no call holds a table's lock while it takes the
store's. Tiered tables share one lock (they share the tiers' memory budget and spill store). A
call that changes several tables (a push, a lookup creating rows) is not atomic against
`begin_snapshot`: the caller cuts a checkpoint between steps (server/shard.py waits for the row
pushes under way). The limit checks are made under the table's lock before it creates rows;
other tables' bytes are read as they are then, so concurrent lookups creating rows in different
tables may together pass `max_table_memory_bytes` by at most one batch of rows each.

With `tiers` (a PS with a table_memory_budget, tables/tiered/tiers.py) every table is a TieredTable,
whose rows beyond its share of the budget live on local disk; without, an EmbeddingTable. Both
implement the Table protocol (table.py), whose calls are made here under the lock alone. `close`
closes the tiers (deleting the spill files): the PS's last call.

When the tiers' spill store fails (spill_condition.py), a call that needed it fails: with the
store's SpillError (RESOURCE_EXHAUSTED) while its disk is full (rows in memory still answer), or,
once the store failed for good, every table call with UnavailableError, as from a PS that is gone
(the PS stops and its shard is recovered from its checkpoint: a worker waits for it as for a
killed PS). That answer waits until the PS stops taking calls (at most FAILED_REPLY_WAIT_S), so
that a worker asking again reaches the new process, not this one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import NoReturn

import numpy as np

from paramserver.base import kernels
from paramserver.base.deadline import Deadline
from paramserver.base.errors import FailedPreconditionError, InvalidArgumentError, NotFoundError, UnavailableError
from paramserver.base.hashing import count_distinct
from paramserver.tables.embedding_table import EmbeddingTable, RowPolicy
from paramserver.tables.limits import TableLimits, check_new_rows, check_new_table, row_bytes, table_bytes
from paramserver.tables.row_snapshot import FrozenSnapshot, RowSnapshot
from paramserver.tables.sparse_optimizers import build_sparse_optimizer
from paramserver.tables.table import Table
from paramserver.tables.tiered.spill_condition import SpillCondition
from paramserver.tables.tiered.spill_store import SpillError
from paramserver.tables.tiered.tiered_table import TieredTable
from paramserver.tables.tiered.tiers import Tiers
from paramserver.wire.half import WIRE_DTYPES, from_wire, to_wire

log = logging.getLogger(__name__)
DEFAULT_MAX_IDS = 1 << 20  # largest id batch one request may carry
# tests set the SNAPSHOT_ sizes small (a test seam) to see many slices and a full budget
SNAPSHOT_SLICE_BYTES = 8 << 20  # rows a checkpoint copies per pause of the tables
SNAPSHOT_BUDGET = 0.10  # rows kept aside for a checkpoint, as a share of the table's bytes...
SNAPSHOT_MIN_BUDGET = 32 << 20  # ...or at least this many bytes
SNAPSHOT_WAIT_S = 30.0  # longest a change waits for a checkpoint's writer to catch up
MAX_CAPACITY = 1 << 30  # rows one shard's table may reserve up front
FAILED_REPLY_WAIT_S = 2.0  # how long the answer of a call that found the spill store failed waits for the PS to stop
# the kinds of table a store makes: mypy checks each against the Table protocol here
TABLE_KINDS: tuple[type[Table], ...] = (EmbeddingTable, TieredTable)


class TableStore:
    """Embedding tables by name."""

    def __init__(
        self,
        shard_index: int,
        max_ids: int = DEFAULT_MAX_IDS,
        restore=None,
        limits: TableLimits | None = None,
        tiers: Tiers | None = None,
    ) -> None:
        self.shard_index = shard_index
        self.restore = restore  # a checkpoint.restore.RestoreSource new tables start from, or None
        self.max_ids = max_ids
        self.limits = limits or TableLimits()
        self.tiers = tiers
        # replaced, never changed in place (a call reads it without the store's lock)
        self._tables: dict[str, Table] = {}
        self._locks: dict[str, threading.Lock] = {}  # each table's (one shared by tiered tables)
        self._tiered_lock = threading.Lock() if tiers is not None else None
        self._wire: dict[str, str] = {}  # wire dtype by table
        self.shard_counts: dict[str, int] = {}  # the shards each table's ids are routed over (its registration's)
        self._lock = threading.Lock()
        self._writer_moved = threading.Condition(self._lock)  # a checkpoint's writer took a slice
        self._snapshots: dict[str, RowSnapshot | FrozenSnapshot] = {}  # of the checkpoint being written
        self.snapshot_epoch = 0  # of the latest snapshot begun (0: none)
        self.epoch = 1  # of the next snapshot; tables stamp the rows they change with it (incremental checkpoints)

    def register(
        self,
        name: str,
        dim: int,
        optimizer_spec: dict,
        init: dict,
        policy: dict | None = None,
        capacity: int = 0,
        num_shards: int = 1,
        wire: str = "float32",
    ) -> None:
        """Create table `name`, or check that the existing one has the same dim, optimizer and wire dtype.

        capacity: rows to reserve room for up front (0: start small and grow). num_shards: how
        many shards the table is spread over (which saved rows are this shard's, on restore).
        """
        if not 0 <= capacity <= MAX_CAPACITY:
            raise InvalidArgumentError(f"table {name!r}: capacity {capacity} is outside [0, {MAX_CAPACITY}]")
        if wire not in WIRE_DTYPES:
            raise InvalidArgumentError(f"table {name!r}: wire dtype {wire!r} is not one of {sorted(WIRE_DTYPES)}")
        with self._spill_checked(), self._lock:
            existing = self._tables.get(name)
            if existing is None:
                optimizer = build_sparse_optimizer(optimizer_spec)
                row_policy = RowPolicy.from_dict(policy)
                self._check_new_table(name, dim, optimizer, row_policy, capacity)
                table = self._new_table(name, dim, optimizer, init, optimizer_spec, row_policy, capacity)
                if isinstance(table, EmbeddingTable):
                    table.epoch = self.epoch
                if self.restore is not None and self.restore.fill_table(table, self.shard_index, num_shards):
                    log.info("shard %d: table %s restored with %d rows", self.shard_index, name, table.size)
                self._locks = {**self._locks, name: self._tiered_lock or threading.Lock()}
                self._wire[name] = wire
                self._tables = {**self._tables, name: table}
                self.shard_counts[name] = num_shards
                log.info("shard %d: table %s (dim %d, %s)", self.shard_index, name, dim, optimizer.name)
            elif (existing.dim, existing.spec, existing.init) != (dim, optimizer_spec, init):
                raise FailedPreconditionError(
                    f"table {name!r} exists with dim {existing.dim}, optimizer {existing.spec}, init {existing.init}"
                )
            elif self._wire[name] != wire:
                raise FailedPreconditionError(
                    f"table {name!r} was registered to travel as {self._wire[name]}, not {wire}"
                )

    def _new_table(self, name, dim, optimizer, init, spec, policy, capacity) -> Table:
        if self.tiers is not None:
            return self.tiers.new_table(name, dim, optimizer, init, spec, policy)
        return EmbeddingTable(name, dim, optimizer, init, spec, capacity=max(1024, capacity), policy=policy)

    def lookup(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows of `ids`, created on first touch (a copy, in the table's wire dtype)."""
        return self.lookup_checked([self.check_lookup(name, ids)])[0]

    def check_lookup(self, name: str, ids: np.ndarray) -> CheckedLookup:
        """Validate a lookup without running it (raises InvalidArgumentError / NotFoundError)."""
        table = self.table(name)
        self._check_ids(name, ids, distinct=False)
        with self._locks[name]:
            check_new_rows(self.limits, table, ids, self._used_if_growing(table, ids))
        return CheckedLookup(table, ids)

    def check_push(self, name: str, ids: np.ndarray, grads: np.ndarray) -> CheckedPush:
        """Validate a row push without applying it, so that a request carrying several changes
        can check them all before any is made. Gradients in the table's wire dtype are upcast to
        float32 first (one that overflowed float16 is infinite: refused)."""
        table = self.table(name)
        self._check_ids(name, ids)
        wire = self._wire[name]
        if grads.dtype != WIRE_DTYPES[wire] or grads.shape != (ids.shape[0], table.dim):
            raise InvalidArgumentError(
                f"table {name!r}: gradient of shape {grads.shape} and dtype {grads.dtype} "
                f"does not match {ids.shape[0]} ids x dim {table.dim} {wire}"
                f"{' (as uint16 bits)' if wire == 'bfloat16' else ''}"
            )
        grads = from_wire(grads, wire)
        if not kernels.all_within(grads, self.limits.max_gradient):
            raise InvalidArgumentError(
                f"table {name!r}: gradient holds NaN or infinite values (or values above "
                f"{self.limits.max_gradient:g} in magnitude: max_gradient_magnitude)"
            )
        return CheckedPush(table, ids, grads)

    def lookup_checked(self, lookups: list[CheckedLookup]) -> list[np.ndarray]:
        """Read (and create) the rows, a table at a time under its lock; the limits are checked
        again there before any of its rows is created (the checks in `check_lookup` ran before
        the request changed anything)."""
        with self._spill_checked():
            self._wait_for_writer()
            return [self._read(lookup) for lookup in lookups]

    def _read(self, lookup: CheckedLookup) -> np.ndarray:
        table = lookup.table
        with self._locks[table.name]:
            check_new_rows(self.limits, table, lookup.ids, self._used_if_growing(table, lookup.ids))
            rows = table.read(lookup.ids)
        return to_wire(rows, self._wire[table.name])

    def push_checked(self, pushes: list[CheckedPush]) -> None:
        """Apply the pushes, a table at a time under its lock."""
        with self._spill_checked():
            self._wait_for_writer()
            for push in pushes:
                with self._locks[push.table.name]:
                    push.table.apply(push.ids, push.grads)

    def apply_rows(self, by_worker: list[list[CheckedPush]]) -> None:
        """Apply the row pushes of one step of several workers as one update per table: each row's
        gradient is the sum of the workers' divided by their number (every worker counts, also
        those without a gradient for the row), as a sync step averages dense gradients."""
        if len(by_worker) == 1:
            self.push_checked(by_worker[0])
            return
        by_table: dict[str, list[CheckedPush]] = {}
        for push in (push for pushes in by_worker for push in pushes):
            by_table.setdefault(push.table.name, []).append(push)
        with self._spill_checked():
            self._wait_for_writer()
            for pushes in by_table.values():
                ids, inverse = np.unique(np.concatenate([p.ids for p in pushes]), return_inverse=True)
                summed = np.zeros((ids.shape[0], pushes[0].table.dim), np.float32)
                np.add.at(summed, inverse.reshape(-1), np.concatenate([p.grads for p in pushes]))
                summed /= np.float32(len(by_worker))
                with self._locks[pushes[0].table.name]:
                    pushes[0].table.apply(ids, summed)

    @contextlib.contextmanager
    def _spill_checked(self) -> Iterator[None]:
        """Around a call that may need the spill store (enter before the lock): once the store
        failed for good, UnavailableError, sent when the PS stops taking calls (module docstring)."""
        condition = None if self.tiers is None else self.tiers.condition
        if condition is None:
            yield
            return
        if condition.failed:
            self._lost(condition, None)
        try:
            yield
        except SpillError as exc:
            if not condition.failed:
                raise  # a full disk: this call fails, the others go on
            self._lost(condition, exc)

    def _lost(self, condition: SpillCondition, cause: SpillError | None) -> NoReturn:
        condition.wait_stopping(FAILED_REPLY_WAIT_S)
        raise UnavailableError(
            f"shard {self.shard_index} lost its spill store ({condition.cause}); "
            f"its PS stops, to be recovered from its checkpoint"
        ) from cause

    # ---- a checkpoint's view of the rows (see RowSnapshot) -----------------------------------
    def begin_snapshot(
        self, since: int | None = None, forget: int | None = None
    ) -> dict[str, tuple[dict, RowSnapshot | FrozenSnapshot]]:
        """Take every table's rows as they are now: {table: (its meta, its snapshot)}; the
        snapshot's epoch is `snapshot_epoch` from then on. Until `end_snapshot`, rows are changed
        as usual; the writer takes them with `next_slice`. One checkpoint at a time (the caller
        serializes them).

        `since`: the epoch of an earlier snapshot to take only the rows changed after (a delta);
        honoured only when every table keeps change stamps (a tiered one does not: then every
        snapshot is whole; `snapshot.since` says which). `forget`: no delta will be asked on a
        snapshot before this epoch (the evicted ids logged up to it are dropped)."""
        with self._lock, self._all_tables():
            epoch = self.epoch
            if not all(isinstance(table, EmbeddingTable) for table in self._tables.values()):
                since = None  # a tiered table keeps no change stamps: every file is whole
            taken: dict[str, tuple[dict, RowSnapshot | FrozenSnapshot]] = {}
            for name, table in self._tables.items():
                if forget is not None and isinstance(table, EmbeddingTable):
                    table.forget_deleted(forget)
                one_row = sum(
                    np.dtype(dtype).itemsize * int(np.prod(shape)) for dtype, shape in table.layout().values()
                )
                budget = max(SNAPSHOT_MIN_BUDGET, int(SNAPSHOT_BUDGET * table.size * one_row))
                slice_rows = max(1, SNAPSHOT_SLICE_BYTES // one_row)
                snapshot: RowSnapshot | FrozenSnapshot
                if isinstance(table, EmbeddingTable):
                    snapshot = table.begin_snapshot(slice_rows, budget, since=since)
                    table.epoch = epoch + 1  # changes from now on belong to the next checkpoint
                else:
                    snapshot = table.begin_snapshot(slice_rows, budget)
                taken[name] = (self._meta(table), snapshot)
                self._snapshots[name] = snapshot
            self.epoch, self.snapshot_epoch = epoch + 1, epoch
            return taken

    def next_slice(self, name: str) -> tuple[int, dict[str, np.ndarray]] | None:
        """The next slice of table `name`'s snapshot (a copy taken under its lock), or None when done."""
        with self._locks[name]:
            taken = self._snapshots[name].next_slice()
        with self._lock:  # after the table's lock (lock order)
            self._writer_moved.notify_all()
        return taken

    def end_snapshot(self) -> dict[str, int]:
        """End the checkpoint's view (also after a failed write); returns each table's peak bytes
        kept aside for it."""
        with self._lock, self._all_tables():
            peaks = {name: snapshot.peak_kept_bytes for name, snapshot in self._snapshots.items()}
            for table in self._tables.values():
                table.end_snapshot()
            self._snapshots.clear()
            self._writer_moved.notify_all()
            return peaks

    @contextlib.contextmanager
    def _all_tables(self) -> Iterator[None]:
        """Hold every table's lock (in name order; the shared lock of tiered tables once): no call
        on any table is under way. Call under the store's lock."""
        with contextlib.ExitStack() as stack:
            taken: set[int] = set()
            for name in sorted(self._locks):
                lock = self._locks[name]
                if id(lock) not in taken:
                    taken.add(id(lock))
                    stack.enter_context(lock)
            yield

    def _wait_for_writer(self) -> None:
        """Hold a change while a checkpoint's writer needs it held (call before the table's lock): while
        the rows kept aside for it are over their budget (memory stays bounded; a writer that
        stalls for SNAPSHOT_WAIT_S lets the change through, logged: memory grows, nothing
        deadlocks), or, for a table that cannot keep rows aside, until the writer is done (the
        writer is this process's own thread: it ends, or fails and ends the snapshot)."""
        if not self._snapshots:  # no checkpoint under way: no lock taken (begin_snapshot holds the tables' locks)
            return
        with self._lock:
            self._wait_while_over_budget()

    def _wait_while_over_budget(self) -> None:
        deadline = Deadline(SNAPSHOT_WAIT_S)
        while any(snapshot.over_budget for snapshot in self._snapshots.values()):
            if deadline.passed():
                if any(s.holds_changes and s.over_budget for s in self._snapshots.values()):
                    log.info(
                        "shard %d: a change waits for a checkpoint's writer (%.0fs)", self.shard_index, SNAPSHOT_WAIT_S
                    )
                    deadline = Deadline(SNAPSHOT_WAIT_S)
                    continue
                log.warning(
                    "shard %d: a checkpoint's writer has not moved for %.0fs; changes go on",
                    self.shard_index,
                    SNAPSHOT_WAIT_S,
                )
                return
            self._writer_moved.wait(deadline.left())

    @staticmethod
    def _meta(table: Table) -> dict:
        return {
            "dim": table.dim,
            "spec": table.spec,
            "init": table.init,
            "policy": asdict(table.policy),
            "counters": dict(table.counters),
            "steps": table.steps,
            "rows": table.size,
        }

    def describe(self) -> dict:
        described = {}
        for name, table in self._tables.items():
            with self._locks[name]:
                described[name] = table.describe()
        return described

    def close(self) -> None:
        """Close the tiered tables' stores and delete the spill space (after the last call)."""
        with self._lock, self._all_tables():
            if self.tiers is not None:
                self.tiers.close()

    def held_bytes(self) -> int:
        """Bytes all tables hold now."""
        return self._bytes()

    def _used_if_growing(self, table: Table, ids: np.ndarray) -> int:
        """All tables' bytes for `check_new_rows`, which reads them only where a lookup of `ids`
        may grow an in-memory table's arrays (its rows past their capacity); 0 elsewhere, as
        summing every table's bytes at each lookup cost more than the lookup's own work."""
        if not isinstance(table, EmbeddingTable) or table.size + ids.shape[0] <= table.capacity:
            return 0
        return self._bytes()

    def _bytes(self) -> int:
        """Bytes all tables hold now: each table's as it is at the moment it is read (a table's
        capacity is one int, changed under its lock)."""
        return sum(table_bytes(table) for table in self._tables.values())

    def _check_new_table(self, name: str, dim: int, optimizer, policy: RowPolicy, capacity: int) -> None:
        if not isinstance(dim, int) or dim < 1:
            raise InvalidArgumentError(f"table {name!r}: dim must be a positive integer, got {dim!r}")
        states = len(optimizer.state_init())
        tracks_use = bool(policy.ttl_steps or policy.min_count or policy.max_rows)
        one_row = row_bytes(dim, states, bool(optimizer.hyper.get("per_row_step")), tracks_use)
        check_new_table(self.limits, name, max(1024, capacity), one_row, self._bytes(), self.tiers is not None)

    def table(self, name: str) -> Table:
        """Table `name` (NotFoundError if this shard holds none), to look at from a test or a tool.
        Calls on it do not take the store's lock: make them while no other call runs."""
        table = self._tables.get(name)
        if table is None:
            raise NotFoundError(f"shard {self.shard_index} holds no table {name!r}")
        return table

    def _check_ids(self, name: str, ids: np.ndarray, distinct: bool = True) -> None:
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise InvalidArgumentError(f"table {name!r}: ids must be a 1-D int64 array, got {ids.dtype} {ids.shape}")
        if ids.shape[0] > self.max_ids:
            raise InvalidArgumentError(f"table {name!r}: {ids.shape[0]} ids exceed the maximum of {self.max_ids}")
        # a push with an id twice would update its row once, silently: refuse it
        if distinct and ids.shape[0] > 1 and count_distinct(ids) != ids.shape[0]:
            raise InvalidArgumentError(f"table {name!r}: ids in one push must be distinct")


@dataclass(frozen=True)
class CheckedLookup:
    """A lookup that passed TableStore.check_lookup."""

    table: Table
    ids: np.ndarray


@dataclass(frozen=True)
class CheckedPush:
    """A row push that passed TableStore.check_push."""

    table: Table
    ids: np.ndarray
    grads: np.ndarray
