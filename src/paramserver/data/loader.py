"""Batches made in a loader process, ahead of the training loop that uses them.

Parsing text is plain CPU work that would otherwise sit on the training loop's critical path;
a loader process does it on another core (or in the time the worker waits for the PS) and
keeps up to `depth` batches ready. The loader is a fresh interpreter that imports only the
batch function's module (no torch unless that module imports it), so it costs tens of MB,
not a copy of the worker.

Wire format on the loader's stdout: 8-byte little-endian length, then a pickled message:
("batch", item) | ("error", exception) | ("end", None). Batches are tuples of numpy arrays
(or anything picklable); the loader runs only code named by its parent, on the same host.

Lifecycle (base/lifecycle.py): `start()` starts the loader process and its reader thread
("loader-<pid>"); `wait_ready(timeout)` blocks until the first batch (or the end, or an error) is
waiting; iterate; `stop(grace)` (iteration to the end, or leaving a `with` block, stops it).
Iterate from one thread; `stop` may come from any.
"""

from __future__ import annotations

import fcntl
import importlib
import logging
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any

from paramserver.base.errors import InvalidArgumentError, ParamServerError
from paramserver.base.lifecycle import Lifecycle, ReadyFlag
from paramserver.base.parent_death import die_with_parent
from paramserver.data.background import queued_batches

log = logging.getLogger(__name__)
_LENGTH = struct.Struct("<Q")
_PIPE_BYTES = 1 << 20


class LoaderError(ParamServerError):
    """The loader process died or stopped answering."""


class BatchLoader(Lifecycle):
    """Runs `fn(*args, **kwargs)` (a generator of batches) in a loader process, `depth` batches ahead.

    fn must be importable by name (a module-level function of an installed or importable module,
    not of the training script itself). An exception raised by fn is raised again here, as itself.
    `timeout_s` bounds the wait for one batch.
    """

    def __init__(
        self, fn: Callable[..., Iterator[Any]], *args: Any, depth: int = 8, timeout_s: float = 300.0, **kwargs: Any
    ) -> None:
        if depth < 1:
            raise InvalidArgumentError(f"loader depth must be at least 1, got {depth}")
        if getattr(fn, "__module__", "__main__") == "__main__" or "<locals>" in fn.__qualname__:
            raise InvalidArgumentError(f"{fn!r}: a loader runs module-level functions of importable modules only")
        self._job = (fn.__module__, fn.__qualname__, args, kwargs)
        self.timeout_s = timeout_s
        self._batches: queue.Queue = queue.Queue(maxsize=depth)
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.ready = ReadyFlag(f"loader for {fn.__module__}.{fn.__qualname__}", LoaderError)

    def start(self) -> BatchLoader:
        """Start the loader process; returns self (`BatchLoader(...).start()`)."""
        with self._lock:
            if self._stopping.is_set():
                raise LoaderError("a stopped loader cannot start again")
            self._spawn()
        return self

    def _spawn(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # no preexec_fn: forking a threaded process (gRPC's) and running Python there can deadlock
        entry = f"from paramserver.data.loader import serve; serve({os.getpid()})"
        self._proc = proc = subprocess.Popen(
            [sys.executable, "-c", entry], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        _widen_pipe(_pipe(proc.stdout).fileno())
        stdin = _pipe(proc.stdin)
        stdin.write(pickle.dumps(self._job))
        stdin.close()
        self._reader = threading.Thread(target=self._read, name=f"loader-{proc.pid}", daemon=True)
        self._reader.start()
        log.info("loader %d started for %s.%s", proc.pid, *self._job[:2])

    @property
    def _process(self) -> subprocess.Popen:
        """The loader process; every caller runs after `_spawn` made it."""
        if self._proc is None:
            raise LoaderError("the loader process has not started")
        return self._proc

    def wait_ready(self, timeout: float) -> None:
        """Block until the first batch (or the end, or an error, which iterating raises) is waiting."""
        self.ready.wait(timeout)

    def __iter__(self) -> Iterator[Any]:
        if self._proc is None:
            self.start()
        try:
            yield from queued_batches(
                self._batches,
                self.timeout_s,
                lambda: LoaderError(f"loader {self._process.pid} sent no batch in {self.timeout_s:.0f}s"),
            )
        finally:
            self.stop()

    def stop(self, grace: float = 2.0) -> None:
        """End the loader process (SIGTERM, SIGKILL after `grace` seconds) and join its reader thread.
        Idempotent; any thread."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
        self.ready.fail(LoaderError("loader stopped"))
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        _pipe(self._proc.stdout).close()
        if self._reader is not None:  # None only when `_spawn` failed before starting it
            self._reader.join(grace)

    def _read(self) -> None:
        """Reader thread: messages from the loader's stdout into the bounded queue."""
        proc = self._process
        fd = _pipe(proc.stdout).fileno()
        try:
            while True:
                header = _read_exact(fd, _LENGTH.size)
                body = _read_exact(fd, _LENGTH.unpack(header)[0]) if header else b""
                if not body:
                    break
                message = pickle.loads(body)
                self._put(message)
                if message[0] != "batch":
                    return
        except Exception as exc:  # a closed pipe after stop(), or a corrupt stream: the loop must hear of it
            if self._stopping.is_set():
                return
            self._put(("error", LoaderError(f"loader {proc.pid}: unreadable batch stream ({exc})")))
            return
        self._put(
            (
                "error",
                LoaderError(f"loader {proc.pid} exited with code {proc.wait()} before its last batch"),
            )
        )

    def _put(self, message: tuple) -> None:
        while not self._stopping.is_set():
            try:
                self._batches.put(message, timeout=0.5)
                self.ready.set()
                return
            except queue.Full:
                continue


def _pipe(stream: IO[bytes] | None) -> IO[bytes]:
    """A pipe of the loader process (it is always started with stdin and stdout pipes)."""
    if stream is None:
        raise LoaderError("the loader process has no pipe to its parent")
    return stream


def _widen_pipe(fd: int) -> None:
    """Let the pipe hold a whole batch (64 KiB by default): the loader writes a batch at once and
    the reader wakes once for it, not once per 64 KiB. Best effort (Linux, within pipe-max-size)."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except (OSError, AttributeError):
        pass


def _read_exact(fd: int, size: int) -> bytes:
    """`size` bytes from a pipe, or b"" at end of stream (reads may come back short)."""
    parts, left = [], size
    while left:
        part = os.read(fd, left)
        if not part:
            return b""
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _send(fd: int, message: tuple) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_LENGTH.pack(len(body)) + body)
    while view:  # writes to a pipe may come back short
        view = view[os.write(fd, view) :]


def serve(parent_pid: int) -> None:
    """The loader process: read the job from stdin, write its batches to stdout."""
    die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before we asked to follow it
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which stops us
    module, name, args, kwargs = pickle.loads(sys.stdin.buffer.read())
    out = sys.stdout.fileno()
    sys.stdout = sys.stderr  # stray prints must not corrupt the stream
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    try:
        for item in fn(*args, **kwargs):
            _send(out, ("batch", item))
    except BrokenPipeError:
        return
    except Exception as exc:  # handed to the training loop, which raises it
        try:
            pickle.dumps(exc)
        except Exception:
            exc = LoaderError(f"{type(exc).__name__}: {exc}")
        _send(out, ("error", exc))
        return
    _send(out, ("end", None))
