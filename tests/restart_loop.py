"""A node kept running as Kubernetes keeps a pod (restartPolicy: OnFailure), for tests that kill nodes.

`RestartLoop(procs, argv, env, netns=None)` starts `argv` (inside network namespace `netns` when
given, through `ip netns exec`, which execs the command: the PID it reports is the node's own) and
starts it again whenever it exits with a non-zero code (a signal included), at most
`max_restarts` times; it is done once the node exits 0. Every life's output (stdout and stderr)
goes to `lines`, every exit code to `exits`. Waits are on those events, each with a timeout; a
timeout fails with the node's last lines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable


class RestartLoop:
    """One node, restarted on failure. `start()`, `kill(sig)`, `wait_for(text)`, `wait_done(timeout)`,
    `stop()`; `exits` (codes, in order: -9 for SIGKILL), `starts` (lives so far), `lines`."""

    def __init__(self, procs, argv: list[str], env: dict[str, str], netns: str | None = None, *,
                 max_restarts: int = 3, name: str = "node") -> None:
        self.procs = procs
        self.argv = ["ip", "netns", "exec", netns, *argv] if netns else list(argv)
        self.env = env
        self.max_restarts = max_restarts
        self.name = name
        self.exits: list[int] = []
        self.starts = 0
        self.lines: list[str] = []
        self.done = False
        self._proc: subprocess.Popen | None = None
        self._stopping = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"restart-loop-{name}", daemon=True)

    def start(self) -> RestartLoop:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            with self._changed:
                if self._stopping:
                    self._finish()
                    return
                proc = self.procs.start(self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, errors="replace")
                self._proc, self.starts = proc, self.starts + 1
                self._changed.notify_all()
            for line in proc.stdout:  # until every holder of the pipe is gone
                with self._changed:
                    self.lines.append(line)
                    self._changed.notify_all()
            code = proc.wait()
            with self._changed:
                self.exits.append(code)
                self._proc = None
                if code == 0 or len(self.exits) > self.max_restarts or self._stopping:
                    self._finish()
                    return

    def _finish(self) -> None:
        self.done = True
        self._changed.notify_all()

    @property
    def pid(self) -> int | None:
        """The running life's PID (the node itself, also inside a namespace), or None between lives."""
        with self._changed:
            return None if self._proc is None else self._proc.pid

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 60.0) -> int:
        """Send `sig` to the running life (waiting for one to run); returns the PID signalled."""
        self._wait(lambda: self._proc is not None, timeout, "a running life to signal")
        with self._changed:
            pid = self._proc.pid
            os.kill(pid, sig)
        return pid

    def wait_for(self, text: str, timeout: float, after: int = 0) -> int:
        """The index of the first line from `after` on that holds `text`, once it was printed."""
        def found() -> int | None:
            return next((i for i in range(after, len(self.lines)) if text in self.lines[i]), None)
        self._wait(lambda: found() is not None, timeout, f"a line with {text!r}", give_up=lambda: self.done)
        with self._changed:
            return found()

    def wait_restarted(self, starts: int, timeout: float) -> None:
        """Until the node has started `starts` times in all."""
        self._wait(lambda: self.starts >= starts, timeout, f"start number {starts}", give_up=lambda: self.done)

    def wait_done(self, timeout: float) -> int:
        """The last exit code, once the loop is done (the node exited 0, or restarts ran out)."""
        self._wait(lambda: self.done, timeout, "the end of its restart loop")
        return self.exits[-1] if self.exits else 0

    def stop(self, timeout: float = 30.0) -> None:
        """No more restarts; the running life is killed. Idempotent."""
        with self._changed:
            self._stopping = True
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def log(self, last: int = 60) -> str:
        with self._changed:
            return f"--- {self.name} (exits {self.exits}) ---\n" + "".join(self.lines[-last:])

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str,
              give_up: Callable[[], bool] = lambda: False) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not ready():
                left = deadline - time.monotonic()
                if left <= 0 or give_up():
                    why = "it is done" if give_up() else f"{timeout:.0f}s"
                    raise AssertionError(f"{self.name}: no {what} ({why})\n{self.log()}")
                self._changed.wait(left)
