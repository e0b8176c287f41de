"""Child processes of the launcher: start in their own session, die with the launcher, stop by group."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, TextIO

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """The kernel SIGKILLs this process when its parent dies, even by SIGKILL (Linux; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Child:
    """One node process whose output is read line by line on a named thread.

    Lifecycle: construct (starts the process), then `stop(grace)`; `stop` is idempotent.
    """

    def __init__(self, label: str, argv: list[str], env: dict[str, str], on_line: Callable[[str, str], None],
                 pass_fds: tuple[int, ...] = ()) -> None:
        self.label = label
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, bufsize=1, pass_fds=pass_fds,
                                     start_new_session=True, preexec_fn=die_with_parent)
        self._reader = threading.Thread(target=self._read, args=(on_line,), name=f"log-{label}", daemon=True)
        self._reader.start()

    def _read(self, on_line: Callable[[str, str], None]) -> None:
        for line in self.proc.stdout:
            on_line(self.label, line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace: float) -> int:
        """SIGTERM the child's process group, SIGKILL it after `grace` seconds; returns the exit code."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(5)
        self._signal(signal.SIGKILL)  # anything the node left in its group
        self._reader.join(2)
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class LineWriter:
    """Writes prefixed lines from many threads without interleaving them. Thread-safe."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self._lock = threading.Lock()

    def write(self, prefix: str, line: str) -> None:
        with self._lock:
            self.out.write(f"[{prefix}] {line}\n" if prefix else line + "\n")
            self.out.flush()


def wait_any(children: list[Child], timeout: float | None) -> Child | None:
    """The first of `children` to have exited within `timeout`, or None."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        for child in children:
            if child.poll() is not None:
                return child
        time.sleep(0.05)
    return None
