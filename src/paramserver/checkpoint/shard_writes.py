"""The checkpoint files a PS writes when the wire asks (a Checkpoint call): names in sequence only.

The chief names a checkpoint by its step and takes it in two moves: every shard writes its file,
then the chief commits the manifest (or deletes what was written, when a shard failed). A shard
writes its file within the call (`__call__`), or in the background (`begin` takes the cut while the
workers are paused and returns; a thread writes the file while training goes on; `collect` gives
the outcome), one file at a time. Its steps
only grow, so on one PS the names it asks for only grow, and each is committed (or deleted)
before the next is asked for. What a PS accepts follows from that:

- A name older than the checkpoint this PS started from, or than one it wrote that was
  committed since, is behind the sequence: refused (FAILED_PRECONDITION), before anything is
  read or written.
- A PS holds at most one checkpoint of its own that is not committed: before it writes another
  name it deletes what it wrote last if nobody committed it. A name far ahead of the chief's step
  (the chief's role suffices to ask) therefore costs one file, gone at the next checkpoint, never
  a disk filled with names that no prune reaches (incomplete checkpoints newer than the latest
  are never pruned, and are never resumed from).

A delta (an incremental checkpoint: `parent` names an earlier checkpoint) is written on the
snapshot this PS took for that checkpoint: the rows changed since (tables/row_snapshot.py). A
PS that did not write `parent` itself (it restarted since) writes a whole file, and its entry
says so (no ``parent``). The parent must be older than the name (names only grow).

Refusals raise before any snapshot or lock (the dispatcher audits them like every refusal).

Each file is checked as it is written with the checks restore applies (shard_file.py): a file
that fails them is not written, and the Checkpoint call fails with a CheckpointError naming the
problem (FAILED_PRECONDITION on the wire), so the chief never commits the checkpoint and counts
it failed (worker/recovery/checkpoints.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from paramserver.base.errors import FailedPreconditionError, InvalidArgumentError, ParamServerError
from paramserver.base.metrics import CheckpointMetrics
from paramserver.checkpoint.files import quantize, shard_file
from paramserver.checkpoint.store import MANIFEST, CheckpointError, CheckpointStore, is_checkpoint_name

log = logging.getLogger(__name__)
_EPOCHS_KEPT = 8  # snapshot epochs remembered, of the names written last (a delta's parent is a recent one)


class ShardWrites:
    """The Checkpoint calls of one PS, writing under its own `directory`. Thread-safe: one write at a time."""

    def __init__(self, directory: str, encoding: str = quantize.NONE, allow_non_finite: bool = False) -> None:
        """`encoding`: how table values are stored (checkpoint/files/quantize.py; "none": float32).
        `allow_non_finite`: a file holding NaN or infinite values is written (the PS's
        restore_non_finite: restore will take it); otherwise it is refused as it is written."""
        if encoding not in quantize.ENCODINGS:
            raise InvalidArgumentError(
                f"checkpoint encoding {encoding!r} is not one of {', '.join(quantize.ENCODINGS)}"
            )
        self.store, self.encoding, self.allow_non_finite = CheckpointStore(directory), encoding, allow_non_finite
        self._lock = threading.Lock()
        self._last: str | None = None  # the name this PS wrote last
        self._committed: str | None = None  # the newest of its names known to be committed
        self._epochs: dict[str, int] = {}  # name -> the snapshot epoch of this PS's file of it
        self._job: _Job | None = None  # the background write begun last
        self.metrics: CheckpointMetrics | None = None  # each file's write timed, failures counted (the node's)

    def __call__(self, name: str, shard: Any, parent: str = "") -> dict[str, Any]:
        """Write `shard`'s file of checkpoint `name` (a delta on `parent` when given and this PS
        wrote it); returns its manifest entry."""
        with self._lock:
            pending = self._begin(name, shard, parent)
            with self._timed():
                return _entry(pending.finish())

    def begin(self, name: str, shard: Any, parent: str = "") -> bool:
        """Take the cut of `shard`'s file of checkpoint `name` now and write it on a thread of its own
        ("checkpoint-<name>"); `collect(name)` gives the outcome. Refused (FAILED_PRECONDITION) while
        the write of an earlier one is under way: the chief collects each before it begins the next.
        Returns whether the shard's tables take no change until the file is written (tiered tables):
        the chief then keeps the workers paused until it is."""
        with self._lock:
            pending = self._begin(name, shard, parent)
            self._job = _Job(name, pending, self._timed)
            return pending.holds_changes

    def collect(self, name: str, wait_s: float) -> dict[str, Any] | int:
        """The manifest entry of the background write of `name` once it is done (or the bytes written
        so far, when it still writes after `wait_s` seconds); raises the error that ended it. Refused
        (FAILED_PRECONDITION) when this PS began no such write (it restarted since: the checkpoint
        cannot hold its file)."""
        job = self._job
        if job is None or job.name != name:
            raise FailedPreconditionError(
                f"checkpoint {name}: this PS has no write of it under way (it may have restarted since it began)"
            )
        if not job.done.wait(wait_s):
            return job.pending.written
        if job.error is not None or job.entry is None:
            raise job.error or CheckpointError(f"checkpoint {name}: its write ended without an entry")
        return job.entry

    def close(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a background write still under way (a PS that stops)."""
        job = self._job
        if job is not None and not job.done.wait(timeout):
            log.warning("checkpoint %s: its write did not end within %.0fs of the PS stopping", job.name, timeout)

    def _timed(self) -> AbstractContextManager[None]:
        return self.metrics.timed() if self.metrics is not None else nullcontext()

    def _begin(self, name: str, shard: Any, parent: str) -> shard_file.PendingFile:
        """The refusals, then the cut (call under the lock)."""
        job = self._job
        if job is not None and not job.done.is_set():
            raise FailedPreconditionError(
                f"checkpoint {name}: this PS still writes {job.name}; collect it before the next one begins"
            )
        self.store.check_new(name)  # a checkpoint name, not a committed checkpoint
        if parent and not (is_checkpoint_name(parent) and parent < name):
            raise InvalidArgumentError(f"parent {str(parent)[:80]!r} is not a checkpoint name before {name}")
        self._check_in_sequence(name, shard)
        self._drop_uncommitted(name)
        on = (parent, self._epochs[parent]) if parent in self._epochs else None
        if parent and on is None:
            log.info("checkpoint %s: this PS has no snapshot of %s; its file is whole", name, parent)
        forget = self._epochs.get(parent or self._committed or "")
        pending = shard_file.begin(
            self.store,
            name,
            shard,
            shard.tables,
            parent=on,
            forget=forget,
            encoding=self.encoding,
            allow_non_finite=self.allow_non_finite,
        )
        self._last = name
        self._epochs[name] = shard.tables.snapshot_epoch
        for old in sorted(self._epochs)[:-_EPOCHS_KEPT]:
            del self._epochs[old]
        return pending

    def _check_in_sequence(self, name: str, shard: Any) -> None:
        if self._last is not None and self._last != name and self._is_committed(self._last):
            self._committed = max(self._committed or self._last, self._last)
        restored = shard.restore.name if shard.restore is not None else None
        floor = max((n for n in (restored, self._committed) if n is not None), default=None)
        if floor is not None and name < floor:
            raise FailedPreconditionError(
                f"checkpoint {name} is behind the sequence: this PS {'started from' if floor == restored else 'wrote'} "
                f"{floor}, and checkpoint names only grow"
            )

    def _drop_uncommitted(self, name: str) -> None:
        """Delete the checkpoint this PS wrote last if nobody committed it (a failed or a stray one)."""
        last = self._last
        if last is None or last == name:
            return
        try:
            if self.store.discard(last):
                log.warning("checkpoint %s: never committed; deleted before %s is written", last, name)
        except CheckpointError as exc:
            log.warning("checkpoint %s: never committed, and cannot be deleted: %s", last, exc)

    def _is_committed(self, name: str) -> bool:
        path = self.store.path(name, MANIFEST)
        try:
            return bool(self.store.fs.exists(path))
        except OSError:
            return False


class _Job:
    """One background write: its thread, and its outcome once `done` is set."""

    def __init__(
        self, name: str, pending: shard_file.PendingFile, timed: Callable[[], AbstractContextManager[None]]
    ) -> None:
        self.name, self.pending, self.timed = name, pending, timed
        self.done = threading.Event()
        self.entry: dict[str, Any] | None = None
        self.error: BaseException | None = None
        # a daemon: a PS that exits mid-write leaves a file no manifest names, as a killed one does
        self.thread = threading.Thread(target=self._run, name=f"checkpoint-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with self.timed():
                self.entry = _entry(self.pending.finish())
        except Exception as exc:  # handed to the chief's collect, which counts the checkpoint failed
            if not isinstance(exc, ParamServerError):
                log.exception("checkpoint %s: the background write raised", self.name)
                exc = CheckpointError(f"checkpoint {self.name}: its write raised {type(exc).__name__}: {exc}")
            self.error = exc
        finally:
            self.done.set()


def _entry(written: Any) -> dict[str, Any]:
    """A ShardFile as the manifest entry the wire carries (no `parent` for a whole file)."""
    described = dataclasses.asdict(written)
    if not described["parent"]:
        del described["parent"]
    return described
