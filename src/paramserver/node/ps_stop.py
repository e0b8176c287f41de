"""What ends a PS process's serving: a signal, a Shutdown, a failed spill store, or the end of a
preemption's grace (node/ps_process.py waits on it).

A signal usually drains the PS at once. But a PS whose run ends it (`stop_ps_at_end`: Kubernetes, a
Slurm job) and that writes checkpoints (`checkpoint_dir`) takes its first SIGTERM or SIGINT as its
share of a preemption: the scheduler signals every process of the run at once (a job's or the pods'
TERM), and the workers' preemption checkpoint (worker/recovery/preemption.py) is written at their
next step, through every PS. So it keeps serving until the chief ends it (a Shutdown), a second
signal comes, or `preempt_grace_s` passed, whichever comes first; then it drains. Where a launcher
stops its PS itself, after the workers (the local launcher, Ray), nothing waits for them: a signal
drains at once.

Thread-safety: `stop` and `signalled` may be called from any thread and from a signal handler;
`wait` from one thread (the process's main loop).
"""

from __future__ import annotations

import logging
import signal
import threading
import time

from paramserver.base.config import Options

log = logging.getLogger(__name__)


def preemption_grace(options: Options) -> float | None:
    """Seconds a PS keeps serving after its first signal (module docstring), None: it drains at once."""
    if options.checkpoint_dir and options.stop_ps_at_end:
        return options.preempt_grace_s
    return None


class StopRequests:
    """The causes that ended (or will end) a PS's serving, in order: signal numbers, "restart", "end", "spill"."""

    def __init__(self, index: int, grace_s: float | None) -> None:
        self.index = index
        self.causes: list[int | str] = []
        self._grace_s = grace_s
        self._deadline: float | None = None  # set by the first signal of a preemption: serving ends then
        self._stopping = threading.Event()

    def stop(self, cause: int | str) -> None:
        """End serving now (the PS then drains)."""
        self.causes.append(cause)
        self._stopping.set()

    def signalled(self, signum: int) -> None:
        """A SIGTERM or SIGINT: drain now, or, the first of a preemption, after the workers' checkpoint."""
        if self._grace_s is None or self._deadline is not None or self._stopping.is_set():
            self.stop(signum)
            return
        self.causes.append(signum)
        self._deadline = time.monotonic() + self._grace_s
        log.warning(
            "ps %d: %s: serving on for the workers' preemption checkpoint, until the chief ends this PS or %.0fs "
            "passed (a second signal drains at once)",
            self.index,
            signal.Signals(signum).name,
            self._grace_s,
            extra={"event": "preemption"},
        )

    def wait(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds; True once serving must end."""
        deadline = self._deadline
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - time.monotonic()))
        if self._stopping.wait(timeout):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            log.info("ps %d: the preemption grace of %.0fs is over: draining", self.index, self._grace_s)
            return True
        return False
