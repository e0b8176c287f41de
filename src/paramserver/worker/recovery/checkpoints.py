"""Checkpoints from the workers' side: periodic ones (pause at a step, let every shard write,
commit) and the final one at a clean end of training.

Every `every` steps of the chief's count, or every `every_seconds` by the chief's clock, the
chief asks the coordinator for a checkpoint; so may anyone with the chief's role (a
RequestCheckpoint call). The coordinator decides: it announces checkpoint number k (requests
while one is under way merge into it), the chief learns it from its request's reply and the
others from their next reply (a heartbeat, within about a second), and every worker stops after
its current step at the one barrier "checkpoint#k". So no push is in flight and every shard holds
the same set of applied pushes (a cut that is consistent across shards in async mode too, and at a
step boundary in sync and ssp modes). The chief then has every shard take its cut (the dense
variables copied, every table's snapshot begun: milliseconds), and "checkpoint#k:written" lets
everyone go on at once: the pause is the barrier and the cut, whatever the tables' size. The
shards write their files in the background, keeping aside the rows training changes before their
writer reaches them (copy-on-write per row, bounded memory), and the chief's commit thread waits
for the files, checks them, writes the manifest (the commit) and prunes old checkpoints. The next
checkpoint begins only after that commit ended, as do the final and the preemption checkpoints,
which wait for their own files too. With `every` and `every_seconds` both 0 nothing is written
while training runs, unless someone asks.

A worker that waits at another barrier (a mode switch, a barrier of the script) when a checkpoint
is announced meets the others for it from there (`meet_announced`): it is at a step boundary with
nothing in flight, and the others could not reach its barrier before the checkpoint is written.

When its training is over, every worker calls `save_final` once: the workers meet at
"checkpoint:final", the chief writes a checkpoint at its own step (unless the latest one it
wrote holds exactly the shards' current state), and "checkpoint:final:written" lets everyone go.
So the newest checkpoint of a run that ended cleanly is the trained model.

A checkpoint that fails (an error from a shard, a full disk, a read-only directory, an
unreachable store: every one a CheckpointError) is logged as an error, counted, and training goes
on: the previous checkpoint stays the latest, and the next checkpoint tries again. What the failed
one had written is deleted (it has no manifest; a full disk gets its space back). The chief hands
its counts to `paramserver run` for the closing JSON line after every checkpoint:
``{"checkpoints_written": n, "checkpoints_failed": m}``, with ``"checkpoint_error"`` (the latest
failure) once one failed; the launcher exits non-zero when checkpoints were asked for and none
was written. Not thread-safe: call from the training thread (the commit thread only finishes the
checkpoint the training thread began, and `settle` joins it before anything reads its outcome).

Incremental checkpoints (`base_every` K > 1): the chief's first checkpoint is a base (every
shard writes its whole file); each later one asks the shards for a delta on the last one it
committed (the rows changed since, docs/checkpoints.md), until K checkpoints make the chain, or
the deltas since the base add up to more than CHAIN_SHARE of the base's bytes: then a new base.
So a restore reads at most a base and K - 1 deltas, and about 1 + CHAIN_SHARE bases' bytes. A
failed checkpoint leaves the chain as it was; a chief (re)started begins with a base.

Names go on from a resume: a checkpoint is named by the run's step, the step of the checkpoint the
run resumed from plus the steps trained since (worker/recovery/lineage.py), for any model. Every manifest
names its run (``"run_id"``, kept across resumes).

A checkpoint counts only once it passed restore's checks: each PS checks its own file with them
as it writes it (the values and row counts of every slice, the header and metadata read back:
checkpoint/files/shard_file.py; a file that fails is not written and its Checkpoint call fails), and
before the manifest is written the chief checks what no single file shows (checkpoint/verdict.py
with contents=False, the manifest given in memory: every file's size, header and metadata, dense
parts tiling their variables, the chain's links), reading a few KB per file. One that fails is
a failed checkpoint like any other (logged with why, counted in `checkpoints_failed`, its files
deleted): never committed, never counted as written, and never the reason an older one is deleted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paramserver.base.errors import FailedPreconditionError, ParamServerError, RollbackError
from paramserver.base.metrics import CheckpointMetrics
from paramserver.checkpoint.store import CheckpointError, CheckpointStore, checkpoint_name, os_reason
from paramserver.client.checkpoint_write import CheckpointWrite
from paramserver.coordinator.membership import checkpoint_barrier
from paramserver.worker import current
from paramserver.worker.recovery.lineage import Lineage
from paramserver.worker.recovery.rollback import restarted_shard

log = logging.getLogger(__name__)
FINAL = "checkpoint:final"
CHAIN_SHARE = 0.5  # deltas since the base past this share of its bytes: the next checkpoint is a base


@dataclass
class _Attempt:
    """One checkpoint being written: its name, the run's step, whether it is the final one, when it
    began, the shards' counters before it, and the checkpoint it is a delta on (None: a base)."""

    name: str
    step: int
    final: bool
    started: float
    counters: list | None
    background: bool = False  # committed on the commit thread: its counts are reported by `settle`
    parent: str | None = None
    data: dict | None = None  # the coordinator's data positions at the cut (coordinator/dispatcher.py)

    @property
    def what(self) -> str:
        return "final checkpoint" if self.final else "checkpoint"


@dataclass
class _Chain:
    """The chain the chief's checkpoints extend: its base, its newest checkpoint, its deltas' count and bytes."""

    base: str
    base_bytes: int
    last: str
    deltas: int = 0
    delta_bytes: int = 0


class Checkpointer:
    def __init__(
        self,
        client,
        store: CheckpointStore | None,
        every: int,
        keep: int,
        worker_index: int,
        barrier: Callable[[str, float | None], object],
        every_seconds: float = 0.0,
        coordinator=None,
        clock: Callable[[], float] = time.monotonic,
        report: Callable[[dict[str, Any]], None] | None = None,
        in_step: bool = False,
        base_every: int = 1,
        allow_non_finite: bool = False,
    ) -> None:
        """`report(values)`: where the chief hands its counts (default: this process's Context's
        `report_result`, which puts them in `paramserver run`'s closing JSON line). `in_step`: the
        workers train in step (dense_sync "allreduce": every step is an all-reduce of them all), so
        each must pause at the same step: every worker asks at its own `every`-th steps, which are
        the chief's, and the coordinator merges their requests into one. `base_every`: a base
        checkpoint every this many, deltas between (1: every checkpoint whole). `allow_non_finite`:
        a checkpoint holding NaN or infinite values passes the checks (as restore_non_finite lets
        restore take it).

        The steps given to `due`, `on_step` and `save_final` are this worker's optimizer's count;
        checkpoints are named by the run's step (`lineage`, set by `resumed` once the shards are
        known). `save` takes the run's step itself."""
        self.base_every = base_every
        self.allow_non_finite = allow_non_finite
        self.lineage = Lineage()  # a fresh run until `resumed` says otherwise
        self._chain: _Chain | None = None  # what the next delta extends (None: the next is a base)
        self.client = client
        self.store = store
        self.every = every if store is not None else 0
        self.every_seconds = every_seconds if store is not None and coordinator is not None else 0.0
        self.keep = keep
        self.in_step = in_step
        self.worker_index = worker_index
        self.barrier = barrier
        self.coordinator = coordinator
        self._clock = clock
        self._last = clock()
        # the last checkpoint this worker met: none yet, so a worker (re)started while the others wait at an
        # announced checkpoint meets them there (one already written opens at once)
        self._met = 0
        self._step = 0  # the latest step `due` was asked about: where this worker is
        self._barrier_after: dict[int, str] = {}  # step -> the barrier `due` decided on for it
        # (name, the shards' counters just before it was written) of the last checkpoint this chief
        # committed: the final checkpoint is not written again when nothing changed since
        self._written: tuple[str, list] | None = None
        self.report = report
        self.written = 0  # checkpoints this chief committed
        self.failed = 0  # and those it could not write (each attempt counts)
        self.last_error: str | None = None
        self.last_failed = False  # the latest attempt failed: the run's newest progress is in no checkpoint
        self._swept = False  # temporary files a killed earlier run left: removed before the first write
        self.metrics: CheckpointMetrics | None = None  # durations and failures, for the node's Prometheus endpoint
        # what the chief runs before the shards write, `hook(timeout)`: e.g. writing the dense values
        # the workers train by all-reduce (optim/dense_sync.py)
        self.before_save: list[Callable[[float], None]] = []
        # the chief's: the data positions the coordinator holds, recorded in each manifest ("data")
        self.data_state: Callable[[], dict | None] | None = None
        self._commit_thread: threading.Thread | None = None  # the commit of a checkpoint written in the background

    def resumed(self, lineage: Lineage) -> None:
        """The run this worker belongs to, and the checkpoint it resumed from (once, when it joins)."""
        self.lineage = lineage
        if self.worker_index == 0:
            if lineage.resumed_from is None:
                log.info("run %s: a fresh start; checkpoints name it in their manifests", lineage.run_id)
            else:
                log.info(
                    "run %s: resumed from %s at step %d; checkpoint names go on from there",
                    lineage.run_id,
                    lineage.resumed_from,
                    lineage.resumed_step,
                )

    def run_step(self, step: int) -> int:
        """The run's step after `step` steps of this worker's optimizer: the step of the checkpoint
        resumed from plus the steps trained since (worker/recovery/lineage.py)."""
        return self.lineage.step_of(step, self.client.record.restored)

    def due(self, step: int) -> bool:
        """Whether the workers meet after `step` (this worker's optimizer's count); decided here,
        once, so that the optimizer can make sure nothing of this worker is in flight before
        `on_step(step)` meets them. The chief asks the coordinator for a checkpoint when the run's
        step or its clock says so; every worker meets at the checkpoint the coordinator announced
        last, if it has not met it yet."""
        return self._due(self.run_step(step))

    def _due(self, step: int) -> bool:
        """`due` at the run's step `step`."""
        self._step = step
        self._reap()
        if step in self._barrier_after:
            return True
        if self.coordinator is None:  # a worker alone: nobody to meet, its own count decides
            if self.every > 0 and step > 0 and step % self.every == 0:
                self._barrier_after[step] = f"checkpoint@{step}"
            return step in self._barrier_after
        if self._wants(step):
            self.coordinator.request_checkpoint()  # the reply names the checkpoint (a new one, or one under way)
        announced = self._announced()
        if announced > self._met:
            self._met = announced
            self._barrier_after[step] = checkpoint_barrier(announced)
        return step in self._barrier_after

    def _wants(self, step: int) -> bool:
        """Whether this worker asks for a checkpoint after `step`: the chief by its step count and
        clock; the others by their step count when the workers train in step."""
        if self.worker_index != 0 and not self.in_step:
            return False
        if self.every > 0 and step > 0 and step % self.every == 0:
            return True
        return self.worker_index == 0 and bool(self.every_seconds) and self._clock() - self._last >= self.every_seconds

    def meet_announced(self, timeout: float) -> bool:
        """Meet the others at a checkpoint announced while this worker waits at another barrier (it
        is at a step boundary, nothing in flight); returns whether it did."""
        announced = self._announced()
        if self.coordinator is None or announced <= self._met:
            return False
        self._met = announced
        log.info("checkpoint #%d announced while waiting at a barrier: meeting the others for it", announced)
        self._meet(checkpoint_barrier(announced), self._step, timeout)
        return True

    def _writable_store(self) -> CheckpointStore:
        """The store checkpoints go to; a Checkpointer made without one never writes."""
        if self.store is None:
            raise FailedPreconditionError("this Checkpointer has no checkpoint store (no checkpoint_dir)")
        return self.store

    def _announced(self) -> int:
        """The number of the coordinator's latest checkpoint, as its latest reply said."""
        return int(self.coordinator.view.get("checkpoints_requested", 0)) if self.coordinator is not None else 0

    def on_step(self, step: int, timeout: float) -> None:
        """After step `step` of this worker's optimizer: meet the others when a checkpoint is due."""
        step = self.run_step(step)
        if self._due(step):
            self._meet(self._barrier_after.pop(step), step, timeout)

    def _meet(self, barrier: str, step: int, timeout: float) -> None:
        self.barrier(barrier, timeout)
        try:
            if self.worker_index == 0:  # the cut now; the files and the commit while training goes on
                self.save(step, timeout, background=True)
        except CheckpointError:
            pass  # logged and counted by save(); the previous checkpoint stays the latest
        finally:
            self._last = self._clock()
            self.barrier(f"{barrier}:written", timeout)

    def save_final(self, step: int, timeout: float, wait: float | None = None) -> str | None:
        """The final checkpoint: every worker calls this once, when its training is over and no
        push of its own is in flight (every optimizer synchronized).

        The workers meet at "checkpoint:final" (a worker waits there for the others to finish
        their data: as long as they are alive, or at most `wait` seconds), the chief writes
        the checkpoint of the run's step after its optimizer's `step` within `timeout`, and
        "checkpoint:final:written" lets everyone go. The chief does not write when the latest
        complete checkpoint is the one it wrote last, at this step, and the shards' counters
        (version, pushes, sync step, mode, tables) are what they were then; nor when it is the
        one the run resumed from and no shard took a push since. Returns the final checkpoint's
        name on the chief (written or already there); None on the other workers, and when it
        could not be written or the workers did not all arrive: that is logged as an error (and
        counted, on the chief) and never raised.
        """
        if self.store is None:
            return None
        try:
            self.barrier(FINAL, wait)
        except ParamServerError as exc:
            log.error("final checkpoint not written: %s; the latest checkpoint stays the last one", exc)
            if self.worker_index == 0:
                self._count_failure(f"final checkpoint not written: {exc}")
            return None
        name = None
        try:
            if self.worker_index == 0:
                name = self._save_final(self.run_step(step), timeout)
        finally:
            try:
                self.barrier(f"{FINAL}:written", wait)
            except ParamServerError as exc:
                log.error("after the final checkpoint: %s", exc)
        return name

    def _save_final(self, step: int, timeout: float) -> str | None:
        self.settle()  # a periodic checkpoint still being written: committed (or not) first
        store = self._writable_store()
        name = checkpoint_name(step)
        counters = self._counters()
        try:
            complete = store.complete()
        except CheckpointError as exc:  # not known what is there: write it (the write says what fails)
            log.warning("final checkpoint %s: %s", name, exc)
            complete = []
        if complete[-1:] == [name] and (self._written == (name, counters) or self._resumed_unchanged(name, counters)):
            log.info("final checkpoint: %s (step %d) holds the final state already", name, step)
            return self._mark_final(name)
        if complete and complete[-1] > name:
            log.warning(
                "final checkpoint %s: %s holds a later checkpoint, %s; resuming and exporting take the latest",
                name,
                store.url,
                complete[-1],
            )
        try:
            return self.save(step, timeout, counters, final=True)
        except CheckpointError:
            return None  # logged and counted by save()

    def _resumed_unchanged(self, name: str, counters: list | None) -> bool:
        """Whether checkpoint `name` is the one the run resumed from and no shard took a push since
        (written again, a failure would cost the run the checkpoint it stands on)."""
        return (
            name == self.lineage.resumed_from
            and counters is not None
            and all(shard.get("pushes") == 0 for shard in counters)
        )

    def _mark_final(self, name: str) -> str:
        """Mark the periodic checkpoint `name` as the final one (an evaluator ends after it); a
        failure is a warning: the checkpoint stays complete, an evaluator ends on its own timeout."""
        store = self._writable_store()
        try:
            store.mark_final(name)
        except CheckpointError as exc:
            log.warning("final checkpoint %s: cannot mark it final: %s", name, exc)
        return name

    def _counters(self) -> list | None:
        """What changes on a shard with every update it applies (None when a shard did not answer)."""
        try:
            stats = self.client.shard_stats()
        except ParamServerError as exc:
            log.warning("checkpoint: cannot read the shards' counters: %s", exc)
            return None
        return [
            {key: shard.get(key) for key in ("shard", "version", "sync_step", "pushes", "mode", "tables")}
            for shard in stats
        ]

    def save(
        self, step: int, timeout: float, counters: list | None = None, final: bool = False, background: bool = False
    ) -> str:
        """Write checkpoint `step` (the run's step) now (chief only; no push may be in flight).
        Returns its name; raises CheckpointError (logged and counted here) when it could not be
        committed or what the shards wrote fails restore's checks, after deleting what it had written.

        `background`: return once every shard took its cut (pushes may go on); the files are written
        and the manifest committed on a thread of this Checkpointer's ("checkpoint-commit"), whose
        outcome is logged and counted, and reported at the next step (`due`) or `settle`. A checkpoint
        begins only after the previous one's commit ended (`settle`).

        A complete checkpoint of the same name is uncommitted first and written again, so that
        its manifest never names files of another state."""
        self.settle()
        attempt = _Attempt(checkpoint_name(step), step, final, time.monotonic(), counters, background)
        try:
            write = self._begin(attempt, timeout)
        except (ParamServerError, OSError) as exc:
            raise self._failed(attempt, exc, report=True) from exc
        if not background or write.holds_changes:  # a tiered shard takes no change until its file is written:
            attempt.background = False  # the workers stay at the barrier (no deadline) rather than time out
            return self._finish(attempt, write)
        self._commit_thread = threading.Thread(
            target=self._finish_quietly, args=(attempt, write), name="checkpoint-commit", daemon=True
        )
        self._commit_thread.start()
        return attempt.name

    def settle(self) -> None:
        """Wait for the commit of a checkpoint written in the background, if one is under way, and
        report its outcome (call from the training thread). Its wait is the shards': each answers within
        a poll or is gone (client/checkpoint_write.py)."""
        thread = self._commit_thread
        if thread is None:
            return
        waited = time.monotonic()
        while thread.is_alive():
            thread.join(timeout=30.0)
            if thread.is_alive():
                log.info("waiting for the checkpoint being written (%.0fs so far)", time.monotonic() - waited)
        self._commit_thread = None
        self._report()

    def _reap(self) -> None:
        """Report a background commit that ended (the chief, at each step)."""
        thread = self._commit_thread
        if thread is not None and not thread.is_alive():
            self.settle()

    def _begin(self, attempt: _Attempt, timeout: float) -> CheckpointWrite:
        """Everything up to the shards' cut: the name made free, the hooks (e.g. dense values written to
        the shards), the delta's parent, then every shard's cut, its file written in the background."""
        store, what, name = self._writable_store(), attempt.what, attempt.name
        if attempt.counters is None:
            attempt.counters = self._counters()
        self._sweep()
        log.info("%s %s: writing %d shards to %s", what, name, len(self.client.channels), store.url)
        if store.uncommit(name):
            log.info("%s %s: replaces the complete checkpoint of that name", what, name)
        for hook in self.before_save:
            hook(timeout)
        if self.data_state is not None:  # the workers wait at the barrier: their positions are exact
            attempt.data = self.data_state()
        attempt.parent = self._parent_for(name)
        write = self.client.begin_checkpoint(name, timeout, parent=attempt.parent or "")
        if not write.begun:  # every shard refused: nothing is being written
            write.collect()  # raises the first refusal
        if attempt.background:  # the launcher's count at the cut: where a roll-back to this checkpoint goes back to
            self._report({"checkpoint_cut": name})
        log.info(
            "%s %s: every shard took its cut in %.2fs%s",
            what,
            name,
            time.monotonic() - attempt.started,
            "; the files are written while training goes on" if attempt.background else "",
        )
        return write

    def _finish_quietly(self, attempt: _Attempt, write: CheckpointWrite) -> None:
        """`_finish` on the commit thread: its failure is logged and counted there."""
        try:
            self._finish(attempt, write)
        except CheckpointError:
            pass
        except Exception as exc:  # e.g. a channel closed under it by partial recovery: not committed, cleaned up
            log.exception("checkpoint %s: its commit raised", attempt.name)
            self._failed(attempt, exc, report=False)

    def _finish(self, attempt: _Attempt, write: CheckpointWrite) -> str:
        """Wait for the shards' files, check them across files and commit the manifest; then count,
        extend the chain and prune. Raises CheckpointError (logged, counted) when it is not committed."""
        store, name, step, parent = self._writable_store(), attempt.name, attempt.step, attempt.parent
        try:
            entries = write.collect()
            self._check_same_shards()
            manifest = {
                "step": step,
                "num_shards": len(entries),
                "shards": entries,
                "mode": self.client.consistency.to_dict(),
                "run_id": self.lineage.run_id,
            }
            delta = any(entry.get("parent") for entry in entries)
            if delta and self._chain is not None:
                manifest.update(parent=parent, base=self._chain.base)
            if attempt.final:
                manifest["final"] = True
            if attempt.data is not None:
                manifest["data"] = attempt.data
            self._check_written(store, name, manifest)
            store.commit(name, manifest)
        except (ParamServerError, OSError) as exc:  # a shard's error, a deadline, the store's CheckpointError
            raise self._failed(attempt, exc, report=not attempt.background) from exc
        if self.metrics is not None:
            self.metrics.duration.observe(time.monotonic() - attempt.started)
        self._written = (name, attempt.counters) if attempt.counters is not None else None
        self._extend_chain(name, delta, sum(e["bytes"] for e in entries))
        self.written += 1
        self.last_failed = False
        if not attempt.background:
            self._report()
        self._prune_after(attempt, sum(e["bytes"] for e in entries), delta)
        return name

    def _prune_after(self, attempt: _Attempt, written: int, delta: bool) -> None:
        """After a commit: delete the checkpoints beyond `keep` and the strays after it; log the commit."""
        store, name, what = self._writable_store(), attempt.name, attempt.what
        try:
            removed = store.prune(self.keep, protect=name) + self._discard_strays(name)
        except (CheckpointError, OSError) as exc:
            removed = []
            log.warning("%s %s: committed, but older checkpoints could not be deleted: %s", what, name, exc)
        took = time.monotonic() - attempt.started
        log.info(
            "%s %s: committed (%d bytes%s) in %.2fs%s",
            what,
            name,
            written,
            f", a delta on {attempt.parent}" if delta else "",
            took,
            f"; removed {', '.join(removed)}" if removed else "",
            extra={"event": "checkpoint_saved", "step": attempt.step, "duration_s": round(took, 3)},
        )

    def _failed(self, attempt: _Attempt, exc: BaseException, report: bool) -> CheckpointError:
        """Log, count and clean up a checkpoint that is not committed; returns the CheckpointError to raise.
        `report`: hand the counts on now (the training thread; the commit thread leaves it to `settle`)."""
        if isinstance(exc, ParamServerError):
            reason = str(exc)
        else:
            reason = f"{type(exc).__name__}: {os_reason(exc) if isinstance(exc, OSError) else exc}"
        took = time.monotonic() - attempt.started
        log.error(
            "%s %s failed after %.2fs; the previous one stays, the next checkpoint tries again: %s",
            attempt.what,
            attempt.name,
            took,
            reason,
            extra={"event": "checkpoint_failed", "step": attempt.step, "duration_s": round(took, 3)},
        )
        self._discard(attempt.name)
        if self.metrics is not None:
            self.metrics.failures.inc()
        self._count_failure(reason, report=report)
        if isinstance(exc, CheckpointError):
            return exc
        return CheckpointError(f"{attempt.what} {attempt.name} not written: {reason}")

    def _check_written(self, store: CheckpointStore, name: str, manifest: dict[str, Any]) -> None:
        """Raise CheckpointError naming the first problem when checkpoint `name`, as `manifest` would
        commit it, fails a check restore applies (checkpoint/verdict.py): those across its files;
        each PS checked its own file's contents as it wrote it."""
        from paramserver.checkpoint.verdict import check_checkpoint  # imported here: only a chief that writes needs it

        try:
            check_checkpoint(store, name, manifest=manifest, allow_non_finite=self.allow_non_finite, contents=False)
        except ParamServerError as exc:  # a CheckpointError naming the problem, or any refusal of the checks
            raise CheckpointError(f"not committed, it fails restore's checks: {exc}") from exc
        except OSError:
            raise  # a store that cannot be read: the failure as it is
        except Exception as exc:  # a check that broke proves nothing: the checkpoint is not known to restore
            log.exception("checkpoint %s: its checks raised", name)
            raise CheckpointError(f"not committed, its checks raised {type(exc).__name__}: {exc}") from exc

    def _parent_for(self, name: str) -> str | None:
        """The checkpoint the next one, `name`, is a delta on; None: a base (see the module docstring)."""
        chain = self._chain
        if self.base_every <= 1 or chain is None or chain.last >= name:
            return None
        if chain.deltas + 1 >= self.base_every or chain.delta_bytes > CHAIN_SHARE * chain.base_bytes:
            return None
        return chain.last

    def _extend_chain(self, name: str, delta: bool, written: int) -> None:
        chain = self._chain
        if not delta or chain is None:
            self._chain = _Chain(base=name, base_bytes=written, last=name)
        else:
            chain.last, chain.deltas, chain.delta_bytes = name, chain.deltas + 1, chain.delta_bytes + written

    def _check_same_shards(self) -> None:
        """A shard that restarted since this worker registered wrote the state it restored, not the cluster's:
        such a checkpoint is never committed (the cluster rolls back instead)."""
        why = restarted_shard(self.client.channels, self.client.incarnations)
        if why is not None:
            raise RollbackError(f"not committed: {why}")

    def _sweep(self) -> None:
        """Before the chief's first write: delete the temporary files that writers killed in an
        earlier run left (no shard writes now: only the chief asks them to)."""
        if self._swept:
            return
        self._swept = True
        store = self._writable_store()
        try:
            store.remove_temporary()
        except CheckpointError as exc:
            log.warning("cannot remove the temporary files of earlier writes: %s", exc)

    def _discard_strays(self, name: str) -> list[str]:
        """Delete the incomplete checkpoints newer than `name`, just committed: no prune would reach them."""
        store = self._writable_store()
        strays = store.strays_after(name)
        for stray in strays:
            store.discard(stray)
        if strays:
            log.warning("checkpoint %s: deleted incomplete checkpoints named after it: %s", name, ", ".join(strays))
        return strays

    def _discard(self, name: str) -> None:
        """Delete what a failed checkpoint wrote (shard files without a manifest)."""
        store = self._writable_store()
        try:
            if store.discard(name):
                log.info("checkpoint %s: deleted the files it had written", name)
        except CheckpointError as exc:
            log.warning("checkpoint %s: cannot delete the files it had written: %s", name, exc)

    def _count_failure(self, reason: str, report: bool = True) -> None:
        """Count a failed checkpoint; `report`: hand the counts on now (on the training thread; the commit
        thread leaves that to `settle`)."""
        self.failed += 1
        self.last_error = reason
        self.last_failed = True
        if report:
            self._report()

    def counts(self) -> dict[str, Any]:
        """What the chief hands to the closing JSON line of `paramserver run`."""
        values: dict[str, Any] = {
            "checkpoints_written": self.written,
            "checkpoints_failed": self.failed,
            "checkpoint_last_failed": self.last_failed,  # always sent: a chief restarted by a roll-back replaces it
        }
        if self.last_error is not None:
            values["checkpoint_error"] = self.last_error
        if self._written is not None:
            values["checkpoint_latest"] = self._written[0]
        return values

    def _report(self, values: dict[str, Any] | None = None) -> None:
        """Hand `values` (default: the counts) to `paramserver run` (the chief only; the training thread)."""
        if self.worker_index != 0:
            return
        report = self.report
        if report is None:
            context = current.existing()  # the Context this Checkpointer belongs to (made after it)
            if context is None:
                return
            report = lambda values: context.report_result(**values)
        report(self.counts() if values is None else values)
