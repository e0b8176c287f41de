"""Context: a worker's view of the cluster, made by join.py (`paramserver.init()`)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from paramserver.base.config import Options
from paramserver.base.consistency_spec import ConsistencySpec
from paramserver.base.errors import InvalidArgumentError
from paramserver.client.ps_client import PSClient
from paramserver.client.table_client import TableClient
from paramserver.coordinator.coordinator_service import CoordinatorClient
from paramserver.worker import current
from paramserver.worker.dispatched import DispatchedBatches, Interleaved, is_splits
from paramserver.worker.modes import ModeSwitcher
from paramserver.worker.pipeline import for_context
from paramserver.worker.progress import ProgressWriter
from paramserver.worker.recovery import preemption
from paramserver.worker.recovery.rollback import restarted_shard
from paramserver.worker.resumable import ResumableBatches

log = logging.getLogger(__name__)
StepHook = Callable[[int], None]  # per-step work of one feature, given the optimizer's step count


@dataclass
class Context:
    """This worker's view of the cluster. Use from the training thread."""

    worker_index: int
    num_workers: int
    num_ps: int
    client: PSClient
    options: Options
    in_process: bool
    progress: ProgressWriter
    modes: ModeSwitcher
    coordinator: CoordinatorClient
    coordinator_host: Any = None  # the coordinator's server, on the worker that hosts it
    checkpointer: Any = None  # worker.checkpoints.Checkpointer when a checkpoint_dir is set
    ops: Any = None  # worker.ops.WorkerOps: health and metrics (a cluster's worker)
    summaries: Any = None  # worker.summaries.Summaries on the chief when a logdir is set
    rollback: Any = None  # worker.rollback.RollbackFlag: set when the cluster rolls back (a PS or the chief restarted)
    optimizers: list = field(default_factory=list, repr=False)  # this worker's PS optimizers, in creation order
    finished: bool = False  # finish_training() ran: this worker's data is done
    data_position: int = 0  # batches resumable() handed out or skipped so far in this process
    address: str | None = None  # this worker's address in the cluster spec (where peers reach it)
    dense_group: Any = None  # worker.dense_sync.AllReduceGroup with dense_sync "allreduce"
    partial: Any = None  # worker.partial.ShardRecovery with recovery "partial": lost shards are restored alone
    dispatched: Any = None  # worker.dispatched.DispatchedBatches while the loop trains data the coordinator hands out
    # the per-step work of the features that are on, in the order a step runs it (refresh_step_hooks)
    _step_hooks: list[StepHook] = field(default_factory=list, init=False, repr=False)
    _pausing: bool = field(default=False, init=False, repr=False)  # a checkpointer or a mode schedule

    def __post_init__(self) -> None:
        self.refresh_step_hooks()

    def refresh_step_hooks(self) -> None:
        """Choose the per-step work from the features on now: a step runs only theirs (a feature that
        is off costs it nothing). Called at construction; call again after setting `rollback` or
        `checkpointer`, or changing the mode schedule, later. Preemption is on when
        `preemption.install` ran before (`paramserver node` installs it before the script starts)."""
        self._pausing = self.checkpointer is not None or bool(self.modes.pending)
        hooks: list[StepHook] = []
        if self.rollback is not None:
            hooks.append(self._check_rollback)
        hooks.append(self._count_step)
        if self._pausing:
            hooks.append(self._pause_after)
        if preemption.installed():
            hooks.append(self._check_preemption)
        self._step_hooks = hooks

    @property
    def resume_step(self) -> int:
        """Batches this worker has trained already (its data position): its own count in the
        checkpoint the cluster resumed from, plus its pushes the PS counted since (0: a fresh
        start, however far the cluster is). Known once the first optimizer exists; `resumable()`
        skips that many batches for you."""
        return self.client.record.position

    def resumable(self, source, epochs: int = 1, steps_per_epoch: int | None = None, prefetch_rows: bool = True):
        """`source`'s batches for `epochs` passes, starting at this worker's data position, and
        `finish_training()` once the last one is consumed; with `prefetch_rows`, each step brings
        back the next batch's embedding rows. See worker/resumable.py and worker/pipeline.py.
        `source` a `paramserver.Splits`: the coordinator hands its splits out (worker/dispatched.py); so it
        does in an elastic run with any `source`, split by batch index (each split reads all of it)."""
        if self.elastic and not is_splits(source):  # workers come and go: no share of the data is a worker's own
            source = Interleaved(source, self.num_workers)
        if is_splits(source):
            if steps_per_epoch is not None:
                raise InvalidArgumentError("steps_per_epoch does not apply to Splits: an epoch is every split once")
            return DispatchedBatches(source, epochs, self, prefetch_rows)
        return ResumableBatches(source, epochs, steps_per_epoch, self, prefetch_rows)

    def pipeline(self, batches):
        """`batches`, each step bringing back the embedding rows of the batch after it (no resumption,
        no finish_training: see `resumable` for both). Iterate after the optimizers are created."""
        return for_context(batches, self)

    def finish_training(self) -> None:
        """This worker's data is done: it leaves every sync/ssp quorum (no step waits for it) and
        tells the coordinator and the launcher, before it waits anywhere. Idempotent; `resumable()`,
        `Trainer.fit` and a clean end of the script call it. A later push brings it back. With
        dense_sync "allreduce" all that waits until the worker steps out, at its next `barrier()` or
        the end of the script (a loop reading one batch ahead ends its data before its last step)."""
        if self.finished:
            return
        if self.dense_group is not None:
            self.dense_group.join_due = self.dense_group.data_ended = True
            return
        self._finish()

    def _finish(self, idle: bool = False) -> None:
        for optimizer in self.optimizers:
            optimizer.synchronize()
        self.client.leave(timeout=self.options.rpc_timeout_s)
        self.coordinator.finish()
        self.progress.done()
        self.finished = True
        if not idle:
            log.info("worker %d finished its data after %d steps", self.worker_index, self.progress.steps)

    def _step_out(self, always: bool) -> None:
        """With dense_sync "allreduce", before this worker waits (out of the shards' quorums already,
        or its data done): answer the others' dense all-reduces until every worker stepped out too
        (optim/dense_sync.py). At a barrier always; at the end of the script when it trained or
        finished its data since it last stepped out."""
        group = self.dense_group
        if group is None or not (always or group.join_due):
            return
        self._finish_if_data_ended()
        group.join()

    def _finish_if_data_ended(self) -> None:
        """dense_sync "allreduce": the finish_training deferred to when the worker steps out."""
        if self.dense_group is not None and self.dense_group.data_ended:
            self.dense_group.data_ended = False
            if not self.finished:
                self._finish()  # no step of the others waits for it while it answers

    @property
    def rejoined(self) -> bool:
        """Whether this worker was restarted into a running cluster (not a whole-cluster resume)."""
        return self.client.record.position != self.client.record.restored

    def pauses_at(self, step: int) -> bool:
        """Whether the workers meet at a barrier after `step` (a checkpoint or a mode switch):
        the optimizer then has no push in flight."""
        if not self._pausing:
            return False
        return (self.checkpointer is not None and self.checkpointer.due(step)) or self.modes.due(step)

    @functools.cached_property
    def tables(self) -> TableClient:
        """The embedding tables of the cluster (used by HashEmbedding through the optimizer)."""
        tables = TableClient(
            self.client.channels,
            self.options.rpc_timeout_s,
            self.client.consistency.to_dict(),
            self.client.worker,
            self.client.compressor,
            self.client.record.note_position,  # a model of tables only learns its data position here
        )
        if self.partial is not None:  # a lookup that finds a shard gone waits for it (worker/recovery/partial.py)
            tables.on_lost = self.partial.after_failed_lookup
        return tables

    is_evaluator: ClassVar[bool] = False  # a training task; an evaluator's is worker.evaluator.EvaluatorContext

    @property
    def is_chief(self) -> bool:
        """True on the worker that does once-per-job work (worker 0)."""
        return self.worker_index == 0

    def report(self, examples: int = 0, loss: float | None = None) -> None:
        """Tell the launcher's progress line (and, on the chief with a logdir, TensorBoard) about
        examples trained and the latest loss."""
        self.progress.update(examples=examples, loss=loss)
        if self.summaries is not None:
            self.summaries.report(examples, loss)

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """Write a scalar of your own to TensorBoard at `step` (default: the latest optimizer step).
        Only the chief writes, and only with a logdir; elsewhere a no-op."""
        if self.summaries is not None:
            self.summaries.log_scalar(name, value, step)

    def report_result(self, **values: Any) -> None:
        """Hand final figures to `paramserver run`, which prints them in its closing JSON line."""
        self.progress.result(values)

    def set_mode(self, mode: str, backup_workers: int | None = None) -> ConsistencySpec:
        """Switch the cluster to "async", "sync" or "ssp:K" now, while training runs (chief only).

        Each shard switches at once; a sync step it had partly gathered is applied first, so no
        pushed gradient is lost. Returns the new mode.
        """
        return self.modes.set_mode(mode, backup_workers)

    def staleness(self) -> dict[str, float]:
        """This worker's pushes so far: latest and mean staleness (in versions), pushes, late drops."""
        record = self.client.record
        return {
            "last": record.staleness,
            "mean": record.staleness_sum / record.pushes if record.pushes else 0.0,
            "pushes": record.pushes,
            "dropped": record.dropped,
        }

    def shard_stats(self) -> list[dict]:
        """Each shard's counters: version, sync step, mode, pushes, late drops, staleness."""
        return self.client.shard_stats()

    def barrier(self, name: str, timeout: float | None = None) -> None:
        """Wait until every worker that has not exited called `barrier(name)` (e.g. before evaluating).

        First this worker steps out of every sync/ssp quorum, so that no step waits for it while it
        waits here (its next push brings it back, into the step under way). Waits while the others
        are alive, however slow; fails at once, naming the worker, when one it needs is dead; with
        `timeout`, fails after that many seconds too.
        """
        self._finish_if_data_ended()
        for optimizer in self.optimizers:
            optimizer.synchronize()
        self.client.leave(self.options.rpc_timeout_s, barrier=name)
        self._step_out(always=True)
        self.coordinator.barrier(name, timeout, between=self._meet_announced_checkpoint(name))

    def _meet_announced_checkpoint(self, barrier: str) -> Callable[[], None] | None:
        """What a worker waiting at `barrier` does when a checkpoint is announced: it meets the others
        for it (they cannot reach `barrier` before it is written), then waits at `barrier` again."""
        checkpointer = self.checkpointer
        if checkpointer is None:
            return None

        def between() -> None:
            if checkpointer.meet_announced(self.options.rpc_timeout_s):
                self.client.leave(self.options.rpc_timeout_s, barrier=barrier)

        return between

    def cluster_view(self) -> dict:
        """The coordinator's latest word: global step (all workers' steps), live workers, worker count."""
        return dict(self.coordinator.view)

    def rollback_reason(self) -> str | None:
        """Why the cluster rolls back (a PS or the chief restarted, or does not answer), or None. Asks the
        peers when no thread has flagged it yet: called when the script failed, to tell a roll-back from a bug."""
        if self.rollback is None:
            return None
        if self.rollback.reason is None:
            reason = restarted_shard(self.client.channels, self.client.incarnations) or self.coordinator.restarted()
            if reason is not None:
                self.rollback.flag(reason)
        return self.rollback.reason

    def on_step(self, step: int) -> None:
        """Called by the optimizer after each step: the work of the features that are on
        (refresh_step_hooks): the roll-back check, progress and heartbeat step, the pauses for
        checkpoints and the mode schedule, preemption. Raises RollbackError once the cluster rolls
        back (`paramserver node` then exits to be restarted)."""
        for hook in self._step_hooks:
            hook(step)

    def _check_rollback(self, _step: int) -> None:
        self.rollback.check()

    def _count_step(self, _step: int) -> None:
        """Progress and the heartbeat's step; a push after finish_training() brought this worker
        back into the quorums."""
        progress, client = self.progress, self.client
        progress.pushed_bytes = client.pushed_bytes
        progress.count_step(client.record.staleness)
        # the steps since the checkpoint the run resumed from, a worker restarted alone counting those of
        # its earlier life too (the shards counted them): `paramserver status` adds the checkpoint's step
        self.coordinator.step = progress.steps + client.record.position - client.record.restored
        if self.dispatched is not None:
            self.dispatched.stepped()
        self.busy()

    def idle(self) -> None:
        """No data for this worker now (others hold the last splits the coordinator hands out): out
        of every quorum, and no checkpoint waits for it, until `busy`."""
        if not self.finished:
            self._finish(idle=True)

    def busy(self) -> None:
        """This worker trains again after `idle` or `finish_training` (a push would bring it back too)."""
        if self.finished:
            self.finished = False
            self.coordinator.resume()
            self.progress.undone()

    def _pause_after(self, step: int) -> None:
        self.pause(step)
        if not self.modes.pending and self.checkpointer is None:
            self.refresh_step_hooks()  # the mode schedule is done: nothing left to pause for

    def _check_preemption(self, step: int) -> None:
        if preemption.requested() is not None:
            self._stop_for_preemption(step)

    def _stop_for_preemption(self, step: int) -> None:
        """SIGTERM or a first Ctrl-C arrived (worker/recovery/preemption.py): the chief has a checkpoint written
        now, at this step boundary, the others leave; then Preempted ends the script."""
        signum = preemption.requested()
        assert signum is not None
        if self.elastic and not self.is_chief:
            self._leave_run(signum, step)
        checkpointer = self.checkpointer
        if self.is_chief and checkpointer is not None:
            for optimizer in self.optimizers:  # nothing of this worker in flight while the shards write
                optimizer.synchronize()
            checkpointer.settle()  # a periodic checkpoint still being written counts before this one
            written = checkpointer.written
            self.coordinator.request_checkpoint()
            checkpointer.meet_announced(self.options.rpc_timeout_s)
            checkpointer.settle()  # a preemption checkpoint counts once its files are written and committed
            if checkpointer.written > written:
                log.info("preemption checkpoint written after step %d; stopping", step, extra={"event": "preempted"})
            else:
                log.error("the preemption checkpoint was not written (see above); stopping after step %d", step)
        raise preemption.Preempted(signum, step)

    @property
    def elastic(self) -> bool:
        """Whether workers join and leave this run while it trains (`max_workers`, docs/elastic.md)."""
        return self.options.max_workers > 0

    def _leave_run(self, signum: int, step: int) -> None:
        """An elastic run's worker asked to go: its pushes applied, out of every quorum, its data handed
        back, it leaves; the others train on."""
        for optimizer in self.optimizers:
            optimizer.synchronize()
        self.client.leave(timeout=self.options.rpc_timeout_s)
        log.info("worker %d leaves the run after step %d", self.worker_index, step, extra={"event": "left"})
        raise preemption.Left(signum, step)

    def pause(self, step: int) -> None:
        """Meet the others at the barriers due after `step`: mode switches, checkpoints."""
        if self.pauses_at(step):  # the launcher's count at a checkpoint is exact: a roll-back goes back to it
            self.progress.flush()
        self.modes.on_step(step, self.options.rpc_timeout_s)
        if self.checkpointer is not None:
            self.checkpointer.on_step(step, self.options.rpc_timeout_s)

    def add_optimizer(self, optimizer: Any) -> str:
        """Record a new optimizer; returns its name, equal on every worker that creates optimizers
        in the same order."""
        name = self.next_optimizer_name()
        self.optimizers.append(optimizer)
        return name

    def next_optimizer_name(self) -> str:
        """The name the next optimizer recorded gets (its tables' and variables' names start with it)."""
        return f"opt{len(self.optimizers)}"

    def shutdown(self, completed: bool = False) -> None:
        """Leave the cluster (steps stop waiting for this worker) and close the connections.

        `completed`: the script ended cleanly; this worker then finishes its data (if not done
        yet) and, with a checkpoint_dir, meets the others for the final checkpoint. The worker
        hosting the coordinator keeps it up while any worker may still need it: until every worker
        exited or died, and those that never joined were given `connect_timeout_s`.
        """
        if completed and not self.optimizers:
            log.warning(
                "worker %d: the script made no paramserver optimizer (ps.optim.*, ps.Trainer): nothing was "
                "pushed to the PS; a torch.optim optimizer trains a private copy that nothing shares or saves",
                self.worker_index,
                extra={"event": "no_steps"},
            )
        try:
            if completed and self.optimizers:
                self.finish_training()
                self._step_out(always=False)
                if self.checkpointer is not None:
                    # named by the optimizer's step count, which goes on from a resumed checkpoint's
                    self.checkpointer.save_final(max(o.steps for o in self.optimizers), self.options.rpc_timeout_s)
        finally:
            if self.checkpointer is not None:  # a checkpoint still being written is committed (or not) first
                self.checkpointer.settle()
            self._close(completed)
        current.forget(self)

    def _close(self, completed: bool) -> None:
        if self.ops is not None:
            self.ops.set_draining()
        if self.summaries is not None:
            self.summaries.stop()
        self.progress.flush()
        self.progress.close(done=completed)
        self.client.leave(timeout=5.0)
        rolling_back = self.rollback is not None and self.rollback.reason is not None
        self.coordinator.stop(leave=not rolling_back)  # a worker restarting after a roll-back is still awaited
        if self.coordinator_host is not None and rolling_back:
            self.coordinator_host.stop(1.0)  # rolling back: every worker restarts, none needs this coordinator
        elif self.coordinator_host is not None:
            started = time.monotonic()
            log.debug("coordinator: serving until every worker is done")
            self.coordinator_host.wait_done(self.options.connect_timeout_s)
            log.debug("coordinator: every worker is done after %.2fs; stopping", time.monotonic() - started)
            self.coordinator_host.stop(1.0)
            if completed and self.options.stop_ps_at_end:
                log.info("the run completed: ending every PS (stop_ps_at_end)")
                self.client.end_shards(self.options.rpc_timeout_s)
        self.client.close()
        if self.ops is not None:
            self.ops.stop()
