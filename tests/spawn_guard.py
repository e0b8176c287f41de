"""The fast tier starts no process: while a test that is not marked `cluster` or `fault` runs (its
set-up, body and teardown), every way to start a process is refused and fails that test.

tests/conftest.py installs the guard around each such test. A refused start raises SpawnRefused at
the call, and is also recorded, so a test whose code swallows the exception (a retry loop, a
thread) still fails with the same message."""

from __future__ import annotations

import multiprocessing.process
import multiprocessing.util
import os
import subprocess
import threading

# the markers that allow a test to start processes
SPAWN_MARKERS = ("cluster", "fault", "net")


class SpawnRefused(RuntimeError):
    """A test outside the cluster/fault tiers tried to start a process."""


def message(nodeid: str, what: str) -> str:
    return (f"{nodeid} started a process ({what}) but is not marked `cluster`: a test that starts "
            f"processes (subprocess, multiprocessing, the launcher, real PS nodes) belongs to the cluster "
            f"tier; mark it @pytest.mark.cluster (or `pytestmark = pytest.mark.cluster` for a whole file), "
            f"or keep it in-process")


def _describe(args) -> str:
    if isinstance(args, (list, tuple)):
        return " ".join(str(a) for a in args)[:200]
    return str(args)[:200]


class Guard:
    """Replaces the process-starting functions while installed; `refused` lists what was refused."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.refused: list[str] = []
        self._saved: list[tuple[object, str, object]] = []
        self._lock = threading.Lock()

    def _refuse(self, what: str):
        with self._lock:
            self.refused.append(what)
        raise SpawnRefused(message(self.nodeid, what))

    def _patch(self, owner: object, name: str, replacement) -> None:
        if hasattr(owner, name):
            self._saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, replacement)

    def install(self) -> Guard:
        """Refuses process starts until uninstall(); `refused` starts empty (one test phase each)."""
        guard = self
        self.refused = []

        def execute_child(popen_self, args, *rest, **kwargs):
            guard._refuse(f"subprocess.Popen: {_describe(args)}")

        def process_start(process_self):
            guard._refuse(f"multiprocessing Process.start: {process_self!r}")

        def spawnv_passfds(path, args, passfds):
            guard._refuse(f"multiprocessing spawn: {_describe(args)}")

        def refuse_os(name):
            def refused(*args, **kwargs):
                guard._refuse(f"os.{name}{'' if not args else ': ' + _describe(args[:2])}")
            return refused

        self._patch(subprocess.Popen, "_execute_child", execute_child)
        self._patch(multiprocessing.process.BaseProcess, "start", process_start)
        self._patch(multiprocessing.util, "spawnv_passfds", spawnv_passfds)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system",
                     "spawnv", "spawnve", "spawnvp", "spawnvpe", "execv", "execve"):
            self._patch(os, name, refuse_os(name))
        return self

    def uninstall(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            setattr(owner, name, original)

    def failure(self) -> str | None:
        """The message to fail the test with, or None when nothing was refused."""
        with self._lock:
            if not self.refused:
                return None
            return message(self.nodeid, "; ".join(self.refused))


def allows_spawning(item) -> bool:
    return any(item.get_closest_marker(name) is not None for name in SPAWN_MARKERS)
