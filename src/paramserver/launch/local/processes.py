"""Child processes of the launcher: start in their own session, die with the launcher, stop by group."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import TextIO

from paramserver.base.parent_death import die_with_parent
from paramserver.launch.logs import as_json_line, node_name


class Child:
    """One node process whose output is read line by line on a named thread.

    Lifecycle: construct (starts the process), then `stop(grace)` (or `stop_all` with others);
    `stop` is idempotent.
    """

    def __init__(
        self,
        label: str,
        argv: list[str],
        env: dict[str, str],
        on_line: Callable[[str, str], None],
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.label = label
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            pass_fds=pass_fds,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self._reader = threading.Thread(target=self._read, args=(on_line,), name=f"log-{label}", daemon=True)
        self._reader.start()

    def _read(self, on_line: Callable[[str, str], None]) -> None:
        stdout = self.proc.stdout
        assert stdout is not None  # started with stdout=PIPE
        for line in stdout:
            on_line(self.label, line.rstrip("\n"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace: float) -> int:
        """SIGTERM the child's process group, SIGKILL it after `grace` seconds; returns the exit code."""
        return stop_all([self], grace)[0]

    def terminate(self) -> None:
        """SIGTERM the child's process group if the child still runs; returns at once."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)

    def wait_until(self, deadline: float) -> int | None:
        """The exit code, waiting for it until `deadline` (time.monotonic()); None if still running then."""
        try:
            return self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the child's process group: the child, if it still runs, and anything it left in the group."""
        self._signal(signal.SIGKILL)

    def join_output(self, timeout: float) -> None:
        """Wait until the child's last output line was handled (at most `timeout` seconds)."""
        self._reader.join(timeout)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_all(children: list[Child], grace: float) -> list[int]:
    """Stop `children` together: SIGTERM every group at once (in list order, nothing waited for in between),
    wait for all of them at once, SIGKILL those still running `grace` seconds after the SIGTERM. Returns the
    exit codes, in order (negative: killed by that signal). Safe on children that already exited."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace
    for child in children:  # one deadline for all: the whole wait is `grace` at most, not `grace` per child
        child.wait_until(deadline)
    for child in children:
        if child.poll() is None:
            child.kill()
    codes = []
    for child in children:
        codes.append(child.proc.wait(5))
        child.kill()  # anything the node left in its group
    output_deadline = time.monotonic() + 2.0
    for child in children:
        child.join_output(max(0.0, output_deadline - time.monotonic()))
    return codes


class LineWriter:
    """Writes prefixed lines from many threads without interleaving them. Thread-safe.

    With `json_lines`, every line is a JSON object instead (launch/logs.py): a node's JSON log line
    passes as it is, any other line is wrapped, naming the node of its prefix ("ps0" -> "ps-0";
    the launcher's own, "run", -> "launcher"). `extra` adds fields to a wrapped line (event, duration_s).
    """

    def __init__(self, out: TextIO, json_lines: bool = False) -> None:
        self.out = out
        self.json_lines = json_lines
        self._lock = threading.Lock()

    def write(self, prefix: str, line: str, **extra: object) -> None:
        if self.json_lines:
            node, role = _node_of(prefix)
            line = as_json_line(line, node, role, **extra)
        with self._lock:
            self.out.write(f"[{prefix}] {line}\n" if prefix and not self.json_lines else line + "\n")
            self.out.flush()


def _node_of(label: str) -> tuple[str, str]:
    """(node, role) of a launcher label: "worker1" -> ("worker-1", "worker"); others are the launcher's."""
    match = re.fullmatch(r"([a-z]+)(\d+)", label)
    return (node_name(match[1], int(match[2])), match[1]) if match else ("launcher", "launcher")


def wait_any(children: list[Child], timeout: float | None) -> Child | None:
    """The first of `children` to have exited within `timeout`, or None."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        for child in children:
            if child.poll() is not None:
                return child
        time.sleep(0.05)
    return None
