"""The body of the Ray actor that runs one node of a run: `python -m paramserver node ...` as a child process
on the actor's Ray node, its output and progress lines streamed back to the driver.

The actor is a thin supervisor holding the node's resources: the child is the same node entry the local
launcher starts (same exit codes, signals and READY line). The child dies with the actor's process
(PR_SET_PDEATHSIG), so a dead actor or a lost Ray node leaves no node process behind.

Thread-safety: Ray calls the methods from the actor's thread pool (max_concurrency > 1): `run` once per
actor (a generator method, streamed), `stop` from another call while `run` streams; `where` and
`free_address` at any time.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import IO

from paramserver.base.config import OPTIONS_ENV, TF_CONFIG_ENV
from paramserver.base.parent_death import die_with_parent
from paramserver.launch import threads
from paramserver.launch.local.ports import free_port

log = logging.getLogger(__name__)
OUTPUT, PROGRESS, EXIT = "out", "progress", "exit"  # the kinds of the (kind, text) records `run` yields
_POLL_S = 1.0  # how often `run` looks at the child while it is silent
_EXIT_WAIT_S = 30.0  # after both streams ended: how long the child may take to be reaped


class NodeRunner:
    """Runs one node process on this actor's Ray node (see the module docstring)."""

    def __init__(self) -> None:
        self._child: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._stopping = False

    def where(self) -> dict[str, str]:
        """This actor's Ray node: its IP address and node id."""
        import ray

        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id()}

    def free_address(self) -> str:
        """HOST:PORT free on this node now (a worker's own address; the chief serves the coordinator there)."""
        import ray

        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def run(self, node_args: list[str], env: dict[str, str], reporting: bool) -> Iterator[tuple[str, str]]:
        """Start `python -m paramserver <node_args>` with `env` added to this process's environment, and
        yield (OUTPUT, line) per output line, (PROGRESS, line) per progress line (a `reporting` node: a
        worker, given a pipe as its progress_fd), then (EXIT, code) once it exited (negative: the signal)."""
        environ = {k: v for k, v in os.environ.items() if k not in (TF_CONFIG_ENV, OPTIONS_ENV)}
        environ.update(threads.wait_policy_env(environ), PYTHONUNBUFFERED="1", **env)
        read_fd, write_fd = os.pipe() if reporting else (-1, -1)
        if reporting:
            options = json.loads(environ.get(OPTIONS_ENV) or "{}")
            environ[OPTIONS_ENV] = json.dumps({**options, "progress_fd": write_fd})
        records: queue.Queue[tuple[str, str] | None] = queue.Queue()
        try:
            with self._lock:
                if self._stopping:
                    return
                self._child = subprocess.Popen(
                    [sys.executable, "-m", "paramserver", *node_args],
                    env=environ,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    text=True,
                    bufsize=1,
                    pass_fds=(write_fd,) if reporting else (),
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
        finally:
            if reporting:
                os.close(write_fd)
        streams: list[tuple[str, IO[str]]] = [(OUTPUT, self._child.stdout)]  # type: ignore[list-item]
        if reporting:
            streams.append((PROGRESS, os.fdopen(read_fd)))
        for kind, stream in streams:
            threading.Thread(target=_pump, args=(kind, stream, records), name=f"pump-{kind}", daemon=True).start()
        open_streams = len(streams)
        while open_streams:
            try:
                record = records.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if record is None:
                open_streams -= 1
            else:
                yield record
        try:
            code = self._child.wait(_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            code = self._child.wait(_EXIT_WAIT_S)
        yield EXIT, str(code)

    def stop(self, grace: float) -> int | None:
        """SIGTERM the node's process group, SIGKILL it after `grace` seconds; its exit code (None: never
        started). Idempotent; no node starts after it."""
        with self._lock:
            self._stopping = True
            child = self._child
        if child is None:
            return None
        if child.poll() is None:
            self._signal(signal.SIGTERM)
        try:
            return child.wait(grace)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            return child.wait(_EXIT_WAIT_S)
        finally:
            self._signal(signal.SIGKILL)  # what the node left in its group

    def _signal(self, sig: int) -> None:
        if self._child is not None:
            try:
                os.killpg(self._child.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _pump(kind: str, stream: IO[str], records: queue.Queue[tuple[str, str] | None]) -> None:
    """Put each line of `stream` on `records` as (kind, line), then None once it ended."""
    try:
        with stream:
            for line in stream:
                records.put((kind, line.rstrip("\n")))
    finally:
        records.put(None)
