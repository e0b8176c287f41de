"""`paramserver run` driven from a test: its output collected line by line, nodes killed by label."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import psutil
from tests.conftest import ROOT
from tests.wait import finished


class LauncherRun:
    """One `paramserver run ... SCRIPT -- ARGS`, started with the test's `procs` fixture."""

    def __init__(self, procs, flags: list[str], script: str, args: list[str]) -> None:
        self.lines: list[str] = []
        self.script = script
        self.proc = procs.start([sys.executable, "-m", "paramserver", "run", "--progress-every", "0", *flags,
                                 str(ROOT / script), "--", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                                        name="test-run-output")
        self._reader.start()

    def output(self, tail: int = 60) -> str:
        return "".join(self.lines[-tail:])

    def wait_for(self, text: str, after: int = 0, timeout: float = 240) -> int:
        """Index of the first line from `after` on that contains `text` (the timeout only guards a hang)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(after, len(self.lines)):
                if text in self.lines[i]:
                    return i
            if self.proc.poll() is not None and not self._reader.is_alive():
                raise AssertionError(f"the run ended before {text!r}:\n{self.output()}")
            time.sleep(0.02)
        raise AssertionError(f"no {text!r} within {timeout}s:\n{self.output()}")

    def kill(self, label: str) -> None:
        """SIGKILL the node the launcher calls `label` (ps0, worker1, ...)."""
        for child in psutil.Process(self.proc.pid).children():
            try:
                command, env = " ".join(child.cmdline()), child.environ()
            except psutil.Error:
                continue
            if label.startswith("ps") and f"--role ps --index {label[2:]}" in command:
                child.kill()
                return
            task = json.loads(env.get("TF_CONFIG", "{}")).get("task", {})
            if label.startswith("worker") and self.script in command and task.get("index") == int(label[6:]):
                child.kill()
                return
        raise AssertionError(f"no node {label} to kill:\n{self.output()}")

    def finish(self, timeout: float = 400) -> dict:
        """Wait for the run to end by itself; it must succeed. Returns its closing JSON line."""
        self.proc.wait(timeout)
        finished(self._reader, "the reader of the launcher's output to reach its end")
        assert self.proc.returncode == 0, self.output(120)
        return json.loads(self.lines[-1])
