"""One parameter-server shard: the variables and tables it holds, and when pushes to them are applied.

The domain object behind the shard service; it knows nothing of gRPC or frames. A worker's training
step on this shard is one call, `step`: it checks every part (gradients, row pushes, lookups, pulled
names) before any changes, then pushes, reads the rows, and pulls.
Thread-safe: every public method may be called from many request threads at once. A push
may block its caller (sync and ssp modes) until its step is applied or its worker may go
on, never longer than `wait_timeout_s`.

One lock (`_cond`) orders the pushes: their checks, the dense variables, the counters. In async and
ssp modes a push's row gradients are applied after it lets go of that lock, under each table's own
lock (tables/table_store.py), so that request threads update different tables on different cores;
a checkpoint's cut (`snapshot`) waits for the row pushes under way and holds new ones back, so
that it still falls between steps. A sync step's rows are applied under the lock, by the push that
completes the step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np

from paramserver.base import kernels
from paramserver.base.consistency_spec import ConsistencySpec
from paramserver.base.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    RollbackError,
    UnavailableError,
)
from paramserver.base.optimizer_specs import check_lr
from paramserver.server.consistency import SyncRound
from paramserver.server.dense import DenseGroup
from paramserver.server.optimizers import build_optimizer
from paramserver.server.quorum import Quorum
from paramserver.tables.limits import raise_hint
from paramserver.tables.table_store import CheckedPush, TableStore
from paramserver.wire.half import WIRE_DTYPES

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Push:
    """One worker's push. `step` matters in sync mode; `base_version` (the shard version its
    gradients were computed from) measures staleness."""

    grads: dict[str, np.ndarray]
    lrs: dict[str, float] = field(default_factory=dict)
    worker: int | None = None
    step: int | None = None
    base_version: int | None = None
    rows: list[CheckedPush] = field(default_factory=list)  # embedding row pushes, checked; applied with the step
    resumed: str | None = None  # the barrier this worker comes from: it opened, all who waited there are back


@dataclass
class Step:
    """One worker's training step on this shard, as it arrived (nothing checked yet). `grads` are
    float32 or the variables' wire dtypes; row gradients are in their tables' wire dtypes."""

    grads: dict[str, np.ndarray]
    pull: list[str]
    row_pushes: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)  # (table, ids, grads)
    lookups: list[tuple[str, np.ndarray]] = field(default_factory=list)  # (table, ids), read after the push
    lrs: dict[str, float] = field(default_factory=dict)
    worker: int | None = None
    step: int | None = None
    base_version: int | None = None
    resumed: str | None = None
    marker: bool = False  # counts as the worker's step with nothing to push


@dataclass
class StepOutcome:
    """What a step's reply says: the shard's counters after it, and the push's fate."""

    version: int
    sync_step: int
    staleness: int = 0
    applied: bool = False


@dataclass
class PushOutcome:
    applied: bool  # False: dropped as late (sync with backups), or only gathered so far
    staleness: int  # versions applied between the gradients' base and this push


@dataclass
class ShardStats:
    pushes: int = 0
    dropped_late: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0


class Shard:
    """Holds dense variable groups and applies pushed gradients with their optimizer."""

    def __init__(
        self, index: int = 0, wait_timeout_s: float = 60.0, restore=None, tables: TableStore | None = None
    ) -> None:
        self.index = index
        self.tables = tables or TableStore(index, restore=restore)  # the shard's part of every embedding table
        self.restore = restore  # a checkpoint.restore.RestoreSource new groups start from, or None
        self.version = 0  # number of updates applied
        self.sync_step = 0  # number of sync steps applied; the step a sync push must carry
        self.spec: ConsistencySpec | None = None
        self.stats = ShardStats()
        self.wait_timeout_s = wait_timeout_s
        self.waiting = 0  # pushes blocked in a sync step or an ssp bound right now
        self._groups: dict[str, DenseGroup] = {}
        # workers that registered with this process: None takes every push; a PS node sets a set, so that a
        # worker from before a restart (or a roll-back) cannot push into the state this one restored
        self.sessions: set[int] | None = None
        self._group_of: dict[str, DenseGroup] = {}
        self._clocks: dict[int, int] = {}  # pushes applied per worker (ssp)
        self._pushes_by: dict[int, int] = {}  # pushes taken per worker since this shard started
        self._quorum = Quorum()  # who sync steps and ssp bounds wait for
        self._round: SyncRound | None = None
        self._sums: dict[str, np.ndarray] = {}
        self._switched = False  # the mode was switched while training (SetMode)
        self._cond = threading.Condition()
        self._applying = 0  # pushes applying their rows outside _cond right now
        self._cutting = False  # a checkpoint's cut waits for them: new ones wait for it

    # ---- variables -------------------------------------------------------------------------
    def register(
        self,
        group: str,
        optimizer_spec: dict,
        initial: dict[str, np.ndarray],
        consistency: ConsistencySpec | None = None,
        worker: int | None = None,
        wire: dict[str, str] | None = None,
    ) -> int:
        """Create a group of variables from initial values, or check an existing one matches.

        The first registration wins, for the values and for the consistency mode: later callers
        (other workers) receive the stored values. A mismatched shape, wire dtype, optimizer or
        consistency mode raises FailedPreconditionError and changes nothing. A registering `worker`
        (a fresh start or a restart) joins the sync step under way with its first push. Initial
        values are float32; `wire` names the variables whose gradients and values travel as
        bfloat16 or float16 (wire/half.py).
        """
        wire = wire or {}
        self._check_initial(group, initial, wire)
        optimizer = build_optimizer(optimizer_spec)
        with self._cond:
            self._check_agrees(consistency, worker)
            self._check_worker(self.spec or consistency or ConsistencySpec(), worker, needed=False)
            existing = self._groups.get(group)
            if existing is None:
                clash = sorted(set(initial) & set(self._group_of))
                if clash:
                    raise FailedPreconditionError(f"variables {clash} already belong to another group")
                self._check_dense_memory(group, optimizer, initial)
                created = DenseGroup(group, optimizer, optimizer_spec, initial, wire)
                if self.restore is not None:
                    for part, value in initial.items():  # every check first: a misfit changes nothing
                        saved = self.restore.dense_part(group, optimizer_spec, part, value.shape)
                        created.load(part, saved.value, saved.state, saved.steps)
                self._groups[group] = created
                self._group_of.update(dict.fromkeys(initial, created))
                log.debug(  # the worker says it at INFO ("parameters registered")
                    "shard %d: registered group %s (%d variables, %d values, %s)",
                    self.index,
                    group,
                    len(initial),
                    created.values.size,
                    optimizer.name,
                )
            else:
                self._check_same(existing, optimizer_spec, initial, wire)
            self._adopt(consistency)
            if worker is not None and self.spec is not None and self.spec.elastic:
                self._joined(worker)
            elif worker is not None:
                self._quorum.registered(worker)
            return self.version

    def _check_dense_memory(self, group: str, optimizer, initial: dict[str, np.ndarray]) -> None:
        """Refuse a new group whose values and optimizer state would take the PS past its memory
        limit (max_table_memory_bytes, counting the tables and the groups held): before any is taken."""
        wanted = sum(value.nbytes for value in initial.values()) * (1 + len(optimizer.init_state(0)))
        held = sum(g.values.nbytes + sum(a.nbytes for a in g.state.values()) for g in self._groups.values())
        tables = self.tables.held_bytes()
        limit = self.tables.limits.max_bytes
        if wanted + held + tables > limit:
            raise ResourceExhaustedError(
                f"group {group!r}: {wanted} bytes of variables and optimizer state would take this PS past "
                f"max_table_memory_bytes ({limit}); it holds {held} bytes of variables and {tables} of tables; "
                f"{raise_hint('max_table_memory_bytes')}"
            )

    @staticmethod
    def _check_initial(group: str, initial: dict[str, np.ndarray], wire: dict[str, str]) -> None:
        if not initial:
            raise InvalidArgumentError(f"group {group!r}: a registration needs at least one variable")
        for name, dtype in wire.items():
            if name not in initial:
                raise InvalidArgumentError(f"group {group!r}: a wire dtype for {name!r}, which it does not register")
            if dtype not in WIRE_DTYPES:
                raise InvalidArgumentError(
                    f"variable {name!r}: wire dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}"
                )
        for name, value in initial.items():
            if value.dtype != np.float32:
                raise InvalidArgumentError(
                    f"variable {name!r}: initial values of dtype {value.dtype} not supported "
                    f"(float32 only; a bfloat16 or float16 variable registers its values "
                    f"as float32 and names its wire dtype)"
                )
            if not kernels.all_finite(value):
                raise InvalidArgumentError(f"variable {name!r}: initial values hold NaN or infinite values")

    def _check_agrees(self, consistency: ConsistencySpec | None, worker: int | None) -> None:
        """Nodes started with different modes are refused at join, never silently reconciled.
        After a switch (SetMode) a worker registering with the mode it was started with is fine."""
        if consistency is None or self.spec is None or self._switched or consistency == self.spec:
            return
        who = "a worker" if worker is None else f"worker {worker}"
        raise FailedPreconditionError(
            f"{who} joined with mode {consistency} for {consistency.workers} workers, but shard {self.index} "
            f"runs {self.spec} for {self.spec.workers} workers: start every node with the same --mode, "
            f"--backup-workers and worker count"
        )

    def _adopt(self, consistency: ConsistencySpec | None) -> None:
        if self.spec is None and consistency is not None:
            self.spec = consistency
            self._quorum.elastic = consistency.elastic
            log.info("shard %d: consistency %s, %d workers", self.index, consistency, consistency.workers)

    @staticmethod
    def _check_same(
        group: DenseGroup, optimizer_spec: dict, initial: dict[str, np.ndarray], wire: dict[str, str]
    ) -> None:
        if optimizer_spec != group.spec:
            raise FailedPreconditionError(
                f"group {group.name!r} was registered with optimizer {group.spec}, not {optimizer_spec}"
            )
        if set(initial) != set(group.slots):
            raise FailedPreconditionError(f"group {group.name!r} holds {sorted(group.slots)}, not {sorted(initial)}")
        for name, value in initial.items():
            if tuple(value.shape) != group.slots[name].shape:
                raise FailedPreconditionError(
                    f"variable {name!r} was registered with shape {group.slots[name].shape}, not {tuple(value.shape)}"
                )
            if wire.get(name, "float32") != group.slots[name].wire:
                raise FailedPreconditionError(
                    f"variable {name!r} was registered to travel as "
                    f"{group.slots[name].wire}, not {wire.get(name, 'float32')}"
                )

    def position(self, worker: int | None) -> int:
        """Batches `worker` has trained as this shard saw them: its position in the checkpoint the
        shard started from, plus its pushes since (a push dropped as late consumed a batch too).
        A restarted worker resumes its data from here; a fresh one starts at 0, in every mode:
        the cluster's step never moves a worker's data."""
        if worker is None:
            return self.restored_position(None)
        with self._cond:
            return self.restored_position(worker) + self._pushes_by.get(worker, 0)

    def restored_position(self, worker: int | None) -> int:
        return self.restore.position(worker) if self.restore is not None else 0

    def positions(self) -> dict[int, int]:
        """Every known worker's position (see `position`)."""
        known = set(self._pushes_by) | (set(self.restore.positions) if self.restore is not None else set())
        return {worker: self.position(worker) for worker in sorted(known)}

    def snapshot(self, read: Callable[[dict[str, DenseGroup], int, int], T]) -> T:
        """Call `read(groups, version, sync_step)` while no push can change them, nor the rows of
        any table (a checkpoint): it waits for the row pushes under way to finish."""
        with self._cond:
            self._cutting = True
            try:
                if not self._cond.wait_for(lambda: self._applying == 0, self.wait_timeout_s):
                    raise DeadlineExceededError(
                        f"shard {self.index}: {self._applying} row pushes still applying after "
                        f"{self.wait_timeout_s:.0f}s; no checkpoint cut"
                    )
                return read(dict(self._groups), self.version, self.sync_step)
            finally:
                self._cutting = False
                self._cond.notify_all()

    def step(self, step: Step, reply: Callable[[StepOutcome, list[tuple[str, np.ndarray]], list[np.ndarray]], T]) -> T:
        """One worker's training step: every part checked (each name looked up once) before any
        changes; then the push (gradients and rows, by the consistency mode; it may wait), the
        lookups (rows after this step's update) and the pull. `reply(outcome, values, rows)` is
        called while no push can change the values (as `pull`'s `read`: it must copy what it keeps)."""
        row_pushes = [self.tables.check_push(table, ids, grads) for table, ids, grads in step.row_pushes]
        lookups = [self.tables.check_lookup(table, ids) for table, ids in step.lookups]
        pulled = [(name, self._lookup(name)) for name in step.pull]
        staleness, applied = 0, False
        if step.grads or row_pushes or step.marker:
            push = Push(step.grads, step.lrs, step.worker, step.step, step.base_version, row_pushes, step.resumed)
            outcome = self.push(push)
            staleness, applied = outcome.staleness, outcome.applied
        sync_step = self.sync_step
        rows = self.tables.lookup_checked(lookups) if lookups else []  # a step without rows takes no table lock
        with self._cond:
            values = [(name, group.wire_view(name)) for name, group in pulled]
            return reply(StepOutcome(self.version, sync_step, staleness, applied), values, rows)

    def pull(self, names: Iterable[str], read: Callable[[int, list[tuple[str, np.ndarray]]], T]) -> T:
        """Call `read(version, [(name, values)])` while no push can change the values: each variable's
        live view, or for one of another wire dtype its values cast to it (a buffer reused by the next pull).

        `read` must copy what it keeps (e.g. encode a reply frame) and must not call back into the shard.
        """
        views = [(name, self._lookup(name)) for name in names]
        with self._cond:
            return read(self.version, [(name, group.wire_view(name)) for name, group in views])

    def assign(self, values: dict[str, np.ndarray]) -> int:
        """Overwrite variables' values (dense variables trained among the workers, written before a
        checkpoint). Every value is checked before any is written; optimizer state, step counts and
        the version stay. Returns the version."""
        checked = [(self._lookup(name), name, value) for name, value in values.items()]
        for group, name, value in checked:
            self._check_grad(group, name, value, "value")
        with self._cond:
            for group, name, value in checked:
                group.view(name)[...] = value
            return self.version

    # ---- pushes ----------------------------------------------------------------------------
    def push(self, push: Push) -> PushOutcome:
        """Validate every gradient, then apply (or gather) them by the consistency mode.

        On any validation error nothing is applied or gathered.
        """
        push, by_group = self._validated(push)
        with self._cond:
            if push.rows and self._cutting:
                self._wait_for_cut()
            spec = self.spec or ConsistencySpec()
            self._check_worker(spec, push.worker)
            self._check_step(spec, push)
            self._check_session(push.worker)
            # every check (the sync step included) before anything changes: a refused push changes nothing
            step = self._target_step(push, self._quorum.is_returning(push.worker)) if spec.mode == "sync" else None
            self._quorum.pushed(push.worker, push.resumed)
            if push.worker is not None:
                self._pushes_by[push.worker] = self._pushes_by.get(push.worker, 0) + 1
            staleness = max(0, self.version - push.base_version) if push.base_version is not None else 0
            if step is not None:
                return self._push_sync(push, step, staleness)
            self._set_lrs(push.lrs)
            self._apply(by_group)
            self._count(staleness)
            if push.rows:
                self._applying += 1
        if push.rows:
            self._apply_rows_unlocked(push.rows)
        if spec.mode == "ssp":
            with self._cond:
                worker = push.worker
                assert worker is not None  # _check_worker refused an ssp push that names no worker
                self._clocks[worker] = self._clocks.get(worker, 0) + 1
                self._cond.notify_all()
                self._wait(
                    lambda: self._ssp_may_go(worker),
                    lambda: f"worker {worker} ahead of the slowest of workers {self._awaited()}",
                )
        return PushOutcome(True, staleness)

    def _apply_rows_unlocked(self, rows: list[CheckedPush]) -> None:
        """A push's rows, applied without `_cond` (counted in `_applying`, which the caller raised
        under it), so that pushes update different tables in parallel."""
        try:
            self._apply_rows([rows])
        finally:
            with self._cond:
                self._applying -= 1
                if self._cutting:
                    self._cond.notify_all()

    def _wait_for_cut(self) -> None:
        """Hold a row push while a checkpoint's cut waits (call under `_cond`)."""
        if not self._cond.wait_for(lambda: not self._cutting, self.wait_timeout_s):
            raise DeadlineExceededError(f"shard {self.index}: a checkpoint's cut took over {self.wait_timeout_s:.0f}s")

    def leave(self, worker: int, barrier: str | None = None) -> None:
        """Worker `worker` finished its data, or waits at `barrier`: sync steps and ssp bounds stop
        waiting for it. Its next push brings it back, into the step under way; so does any push
        that comes from `barrier` (the barrier opened: everyone who waited there is back at once,
        so that the first one to push does not take a step alone)."""
        with self._cond:
            self._check_worker(self.spec or ConsistencySpec(), worker)
            self._quorum.leave(worker, barrier)
            self._apply_round_if_complete()
            self._cond.notify_all()
        log.debug("shard %d: worker %d %s", self.index, worker, f"waits at {barrier!r}" if barrier else "left")

    def forget(self, worker: int, why: str) -> None:
        """The coordinator found `worker` gone for good (dead, with no restart): a wait that needs it
        fails at once, naming it, instead of running into its deadline. A registration brings it back."""
        with self._cond:
            self._check_worker(self.spec or ConsistencySpec(), worker)
            self._quorum.forget(worker, why)
            self._apply_round_if_complete()
            self._cond.notify_all()
        log.warning("shard %d: worker %d is gone (%s)", self.index, worker, why)

    def _apply_round_if_complete(self) -> None:
        """A worker left the quorum: the step under way may have all the pushes it needs now."""
        if self._round is not None and self._round.contributors and len(self._round.contributors) >= self._needed():
            self._apply_round()

    def _needed(self) -> int:
        """Pushes the sync step under way needs."""
        spec = self.spec or ConsistencySpec()
        return self._quorum.size(spec.quorum, spec.workers)

    def set_mode(self, spec: ConsistencySpec) -> None:
        """Switch the consistency mode now. A sync step partly gathered is applied first, so no
        gathered gradient is lost, and every waiting pusher re-checks under the new mode."""
        with self._cond:
            if self.spec is not None and self.spec.workers and spec.workers != self.spec.workers:
                raise FailedPreconditionError(
                    f"shard {self.index}: a mode for {spec.workers} workers contradicts the cluster's "
                    f"{self.spec.workers} workers"
                )
            if self._round is not None and self._round.contributors:
                self._apply_round()
            self._round = None
            self.spec = spec
            self._quorum.elastic = spec.elastic
            self._switched = True
            self._cond.notify_all()
        log.info(
            "shard %d: consistency is now %s (at version %d, sync step %d)",
            self.index,
            spec,
            self.version,
            self.sync_step,
        )

    def _check_step(self, spec: ConsistencySpec, push: Push) -> None:
        """With backups, shards apply a step at different moments: a worker may push the step after
        this shard's current one (it adopted another shard's), never further ahead."""
        if spec.mode == "sync" and push.step is not None and push.step > self.sync_step + 1:
            raise FailedPreconditionError(
                f"worker {push.worker} pushed step {push.step}, but shard {self.index} is at step {self.sync_step}"
            )

    def _push_sync(self, push: Push, step: int, staleness: int) -> PushOutcome:
        if step > self.sync_step:  # another shard applied the step under way here already: in order
            self._wait(
                lambda: self.sync_step >= step or not self._is_sync(),
                lambda: f"step {step} waiting for step {self.sync_step}, for workers {self._awaited()}",
            )
            if not self._is_sync():
                return self._apply_now(push, staleness)
        if step < self.sync_step:
            self.stats.dropped_late += 1  # a backup's gradient for a step already applied
            return PushOutcome(False, self.sync_step - step)
        if self._round is None or self._round.step != step:
            self._round = SyncRound(step)
        self._set_lrs(push.lrs)
        assert push.worker is not None  # push() refused (_check_worker) a sync push that names no worker
        self._round.add(push.worker, push.grads, self._sums)
        self._round.rows.append(push.rows)
        self._count(staleness)
        if len(self._round.contributors) >= self._needed():
            self._apply_round()
            self._cond.notify_all()
        else:
            self._wait(
                lambda: self.sync_step > step or not self._is_sync(),
                lambda: f"step {step} waiting for workers {self._awaited()}",
            )
        return PushOutcome(True, staleness)

    def _target_step(self, push: Push, returning: bool) -> int:
        """The step a sync push belongs to. A worker that has not pushed the open step joins it: one
        back from a start, a restart or a barrier, and one that adopted the step after it from a
        shard that is ahead (so no worker ever waits for itself). A returning worker whose earlier
        life pushed the open step pushes the next one; a claimed step already applied is late."""
        step = push.step if push.step is not None else self.sync_step
        contributed = (
            self._round is not None and self._round.step == self.sync_step and push.worker in self._round.contributors
        )
        if not contributed:
            return self.sync_step if returning or step > self.sync_step else step
        if returning:
            return self.sync_step + 1
        if step == self.sync_step:
            raise InvalidArgumentError(f"worker {push.worker} already pushed step {step}")
        return step

    def _apply_now(self, push: Push, staleness: int) -> PushOutcome:
        """A push that waited for a step while the mode switched away from sync: applied on arrival."""
        self._set_lrs(push.lrs)
        self._apply(self._by_group(push.grads))
        self._apply_rows([push.rows])
        self._count(staleness)
        return PushOutcome(True, staleness)

    def _by_group(self, grads: dict[str, np.ndarray]) -> dict[DenseGroup, dict[str, np.ndarray]]:
        """Gradients (of known variables) sorted by the group that holds each."""
        by_group: dict[DenseGroup, dict[str, np.ndarray]] = {}
        for name, grad in grads.items():
            by_group.setdefault(self._group_of[name], {})[name] = grad
        return by_group

    def _is_sync(self) -> bool:
        return self.spec is not None and self.spec.mode == "sync"

    def _awaited(self) -> list[int]:
        """Workers a step under way still waits for (in the quorum, not in yet)."""
        return self._quorum.awaited((self.spec or ConsistencySpec()).workers, self._pushed())

    def _pushed(self) -> set[int]:
        return self._round.contributors if self._round is not None else set()

    def open_session(self, worker: int | None) -> None:
        """`worker` registered (a group or a table) with this process: its pushes are taken from now on.
        In an elastic run it is in the quorum from now on, and its ssp clock starts at the slowest
        present worker's, so that no worker waits for a newcomer to catch up on steps it never took."""
        with self._cond:
            if self.sessions is not None and worker is not None:
                self.sessions.add(worker)
            if worker is not None and self.spec is not None and self.spec.elastic:
                self._joined(worker)

    def _joined(self, worker: int) -> None:
        """An elastic run's `worker` registered (call under `_cond`): in the quorum, its clock at the slowest's."""
        assert self.spec is not None  # elastic: a mode was set
        others = [self._clocks.get(w, 0) for w in self._quorum.active(self.spec.workers) if w != worker]
        self._quorum.registered(worker)
        self._clocks[worker] = max(self._clocks.get(worker, 0), min(others, default=0))

    def _check_session(self, worker: int | None) -> None:
        """Refuse a push from a worker that has not registered with this PS process: it registered with an
        earlier one, which restarted (or was rolled back) since; its gradients belong to that state."""
        if self.sessions is not None and worker is not None and worker not in self.sessions:
            raise RollbackError(
                f"shard {self.index}: worker {worker} has not registered with this PS since it "
                f"started (it restarted, or the cluster rolls back): the worker must restart"
            )

    def describe(self) -> dict:
        """Counters and mode, for Hello replies and monitoring."""
        with self._cond:
            stats = self.stats
            return {
                "version": self.version,
                "sync_step": self.sync_step,
                "groups": len(self._groups),
                "mode": str(self.spec or ConsistencySpec()),
                "pushes": stats.pushes,
                "dropped_late": stats.dropped_late,
                "waiting": self.waiting,
                "staleness_max": stats.staleness_max,
                "staleness_mean": stats.staleness_sum / stats.pushes if stats.pushes else 0.0,
            }

    def _apply_round(self) -> None:
        assert self._round is not None  # every caller has a step under way
        self._apply(self._by_group(self._round.averages(self._sums)))
        self._apply_rows(self._round.rows)
        self.sync_step += 1
        self._round = None

    def _apply_rows(self, by_worker: list[list[CheckedPush]]) -> None:
        if any(by_worker):
            self.tables.apply_rows(by_worker)

    def check_mode(self, spec: ConsistencySpec) -> None:
        """Raise as `adopt_mode` would, changing nothing."""
        with self._cond:
            self._check_agrees(spec, None)

    def adopt_mode(self, spec: ConsistencySpec) -> None:
        """Take `spec` as the consistency mode if none was set yet (a shard holding only embedding
        rows learns the mode from a table registration); a different mode is refused."""
        with self._cond:
            self._check_agrees(spec, None)
            self._adopt(spec)

    def _apply(self, by_group: dict[DenseGroup, dict[str, np.ndarray]]) -> None:
        for group, grads in by_group.items():
            group.apply(grads)
        self.version += 1

    def _set_lrs(self, lrs: dict[str, float]) -> None:
        for group_name, lr in lrs.items():
            self._groups[group_name].optimizer.set_lr(lr)

    def _ssp_may_go(self, worker: int) -> bool:
        spec = self.spec
        if spec is None or spec.mode != "ssp":
            return True
        active = self._quorum.active(spec.workers) or [worker]
        slowest = min(self._clocks.get(w, 0) for w in active)
        return self._clocks[worker] - slowest <= spec.staleness

    def _wait(self, ready: Callable[[], bool], what: Callable[[], str]) -> None:
        """Wait for other workers' pushes while those awaited are alive; fail at once, naming the
        worker, when one that is needed is gone for good. `wait_timeout_s` is the last resort
        against a peer that neither pushes nor is found gone (it is the PS's rpc_timeout_s)."""
        self.waiting += 1  # pushes blocked right now (monitoring; tests wait on it)
        try:
            done = self._cond.wait_for(lambda: ready() or self._needed_gone(), self.wait_timeout_s)
        finally:
            self.waiting -= 1
        if not done:
            raise DeadlineExceededError(f"shard {self.index}: {what()} for over {self.wait_timeout_s:.0f}s")
        gone = self._needed_gone()
        if gone and not ready():
            raise UnavailableError(
                f"shard {self.index}: {what()}, but worker {gone[0]} is gone ({self._quorum.gone[gone[0]]})"
            )

    def _needed_gone(self) -> list[int]:
        """Gone workers whose pushes a wait here still needs."""
        if self.spec is None:
            return []
        needed = self._needed() if self.spec.mode == "sync" else None
        return self._quorum.needed_gone(self.spec.workers, self._pushed(), needed)

    def _count(self, staleness: int) -> None:
        self.stats.pushes += 1
        self.stats.staleness_sum += staleness
        self.stats.staleness_max = max(self.stats.staleness_max, staleness)

    # ---- validation ------------------------------------------------------------------------
    def _validated(self, push: Push) -> tuple[Push, dict[DenseGroup, dict[str, np.ndarray]]]:
        """The push with its gradients checked and upcast to float32, and them by group."""
        by_group: dict[DenseGroup, dict[str, np.ndarray]] = {}
        grads = {}
        for name, grad in push.grads.items():
            group = self._lookup(name)
            checked = group.gradient(name, grad, self.tables.limits.max_gradient)
            grads[name] = by_group.setdefault(group, {})[name] = checked
        for group_name, lr in push.lrs.items():
            if group_name not in self._groups:
                raise NotFoundError(f"shard {self.index} holds no group {group_name!r}")
            check_lr(lr)
        return replace(push, grads=grads), by_group

    def _check_worker(self, spec: ConsistencySpec, worker: int | None, needed: bool = True) -> None:
        if needed and spec.mode != "async" and worker is None:
            raise InvalidArgumentError(f"a push in {spec.mode} mode must name its worker")
        if worker is not None and worker < 0:
            raise InvalidArgumentError(f"worker {worker} is negative")
        if worker is not None and spec.workers and not 0 <= worker < spec.workers:
            raise InvalidArgumentError(f"worker {worker} is outside the cluster's {spec.workers} workers")

    def _lookup(self, name: str) -> DenseGroup:
        group = self._group_of.get(name)
        if group is None:
            raise NotFoundError(f"shard {self.index} holds no variable {name!r}")
        return group

    @staticmethod
    def _check_grad(group: DenseGroup, name: str, grad: np.ndarray, what: str = "gradient") -> None:
        slot = group.slots[name]
        if grad.dtype != np.float32:
            raise InvalidArgumentError(f"{what} of {name!r} has dtype {grad.dtype}, expected float32")
        if tuple(grad.shape) != slot.shape:
            raise InvalidArgumentError(f"{what} of {name!r} has shape {tuple(grad.shape)}, expected {slot.shape}")
        if not kernels.all_finite(grad):
            raise InvalidArgumentError(f"{what} of {name!r} holds NaN or infinite values")
