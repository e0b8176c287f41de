"""Whether a PS's spill stores work: "ok", "full" (their disk is full) or "failed" (for good).

A spill store that cannot write because its disk is full keeps every row it has (rows not written
stay in memory): the PS goes on answering what needs no write to disk, refuses what does (the
request fails with SpillError, RESOURCE_EXHAUSTED, naming the disk), and is "full". RocksDB resumes
writing by itself once space is free again (it polls for it); the first write that succeeds makes
the PS "ok" again. A disk that stays full for `full_grace_s` (`Options.spill_full_grace_s`) makes it
"failed": a PS must not answer errors for the rest of a run.

Any other failure (a read or write error, a file changed or removed under the store, the spill
subdirectory removed or replaced) is "failed" at once: rows on disk can no longer be trusted, so
the shard's state is lost and it is recovered as for a killed PS, from its checkpoint (the PS
stops and exits with the code that makes its launcher recover it: node/ps_process.py).

Each change of state is told to the listeners (the PS node: its health and its stop), with the
cause. Thread-safe: stores report from request threads, `check` runs on the PS's main thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from paramserver.base.config import Options

log = logging.getLogger(__name__)
OK, FULL, FAILED = "ok", "full", "failed"
FULL_GRACE_S: float = Options.spill_full_grace_s  # the option's default: a disk full longer fails the shard

Listener = Callable[[str, str], None]  # (state, cause)


class SpillCondition:
    """The state of a PS's spill stores and its cause (empty when ok)."""

    def __init__(self, full_grace_s: float = FULL_GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.full_grace_s = full_grace_s
        self.state, self.cause = OK, ""
        self._since = 0.0  # when the disk was found full
        self._clock = clock
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []
        self.stopping = threading.Event()  # set by the PS node once it stops taking calls

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def wait_stopping(self, timeout: float) -> None:
        """Until the PS stops taking calls (at most `timeout`; at once where no PS listens)."""
        if self._listeners:
            self.stopping.wait(timeout)

    @property
    def failed(self) -> bool:
        return self.state == FAILED

    def disk_full(self, cause: str) -> None:
        """A write found the disk full (rows not written stay in memory)."""
        with self._lock:
            if self.state != OK:
                return
            self.state, self.cause, self._since = FULL, cause, self._clock()
        self._tell(FULL, cause)

    def wrote(self) -> None:
        """A write succeeded: a full disk has room again. Cheap when nothing was wrong (every write calls it)."""
        if self.state != FULL:
            return
        with self._lock:
            if self.state != FULL:
                return
            self.state, self.cause = OK, ""
        self._tell(OK, "the spill store writes again")

    def fail(self, cause: str) -> None:
        """The stores cannot be trusted any more: the shard must be recovered from its checkpoint."""
        with self._lock:
            if self.state == FAILED:
                return
            self.state, self.cause = FAILED, cause
        self._tell(FAILED, cause)

    def check(self, problem: str | None = None) -> str:
        """Apply what a periodic look found (`problem`: what is wrong with the spill directory, or
        None) and the time a full disk has lasted; returns the state."""
        if problem is not None:
            self.fail(problem)
        elif self.state == FULL and self._clock() - self._since > self.full_grace_s:
            self.fail(f"the spill disk stayed full for more than {self.full_grace_s:.0f}s ({self.cause})")
        return self.state

    def _tell(self, state: str, cause: str) -> None:
        for listener in list(self._listeners):
            try:
                listener(state, cause)
            except Exception:  # a listener's bug must not hide the store's own error
                log.exception("a listener of the spill store's state failed")
