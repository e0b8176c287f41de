"""Restart loops standing in for Kubernetes: each node's command is started again whenever it exits
with a non-zero code (restartPolicy: OnFailure), and is left alone once it exits 0.

Every line a node prints is kept as "[name] line", in the order read, so a test can wait for a line
(`wait_for`) and see the whole cluster's output on failure (`log`). Nothing here decides a verdict by
time: `wait_for` and `wait_done` take generous deadlines that only stop a hung test.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time


class NodeLoops:
    """Named restart loops over the `procs` fixture's processes. Thread-safe."""

    def __init__(self, procs, max_restarts: int = 20) -> None:
        self.procs = procs
        self.max_restarts = max_restarts
        self.lines: list[str] = []
        self.exits: dict[str, list[int]] = {}  # by node: every exit code of its processes, in order
        self.current: dict[str, subprocess.Popen] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._threads: list[threading.Thread] = []

    def start(self, name: str, args: list[str], env: dict[str, str]) -> None:
        """Run `paramserver ARGS` as node `name` under a restart loop."""
        argv = [sys.executable, "-m", "paramserver", "--log-level", "INFO", *args]
        self.exits[name] = []
        thread = threading.Thread(target=self._loop, args=(name, argv, env), name=f"restart-loop-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _loop(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    return
                proc = self.procs.start(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                self.current[name] = proc
            for line in proc.stdout:
                with self._cond:
                    self.lines.append(f"[{name}] {line.rstrip()}")
                    self._cond.notify_all()
            code = proc.wait()
            with self._cond:
                self.exits[name].append(code)
                self.lines.append(f"[loop] {name} exited with {code}")
                self._cond.notify_all()
                if code == 0 or self._stopping or len(self.exits[name]) > self.max_restarts:
                    return

    def wait_for(self, fragment: str, start: int = 0, timeout: float = 120.0) -> int:
        """Index of the first line from `start` on that contains `fragment`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for index in range(start, len(self.lines)):
                    if fragment in self.lines[index]:
                        return index
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line with {fragment!r} within {timeout:.0f}s\n{self.log()}")
                self._cond.wait(left)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        with self._cond:
            self.current[name].send_signal(sig)

    def wait_done(self, names: list[str], timeout: float = 180.0) -> None:
        """Until each of `names` exited 0 (its loop ended)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all(self.exits[n] and self.exits[n][-1] == 0 for n in names):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{names} not all done within {timeout:.0f}s: {self.exits}\n{self.log()}")
                self._cond.wait(left)

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM every node still running (a PS drains and exits 0) and end the loops."""
        with self._cond:
            self._stopping = True
            running = [proc for proc in self.current.values() if proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        for thread in self._threads:
            thread.join(grace)

    def log(self) -> str:
        return "\n".join(self.lines[-400:])
