"""The one shape of every long-lived thing: servers, a PS node, a heartbeat, a loader, a cluster.

    thing = Thing(...)          # builds; starts nothing (no thread, no process, no RPC)
    thing.start()               # starts its threads / processes; returns what the class documents
    thing.wait_ready(timeout)   # blocks until it serves; raises when it failed or `timeout` passed
    ...
    thing.stop(grace)           # stops it; idempotent

or, the same with a `with` block (`__enter__` calls `start()`, `__exit__` calls `stop()` with the
class's default grace, also when the block raised):

    with Thing(...) as thing:
        thing.wait_ready(timeout)
        ...

Rules every class keeps:
- `start()` is called once. It may block briefly (binding a port) but never waits for a peer;
  waiting is `wait_ready`'s job, bounded by its `timeout`.
- `wait_ready(timeout)` may be called any number of times, from any thread, after (or while)
  `start()` runs. It raises the error that stopped the start, or a ParamServerError (usually
  UnavailableError) naming what was not ready in time.
- `stop(grace)` may be called from any thread, more than once, before `start()`, after a failed
  `start()`, or while `wait_ready` blocks in another thread. In-flight work gets `grace` seconds;
  when `stop` returns, every thread the object started has ended or is joined with a bound
  (documented per class), and every child process it started has exited and been reaped.
- Every thread an object starts has a name saying what it does and whose it is.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any

from paramserver.base.errors import ParamServerError, UnavailableError

RESTART_EXIT_CODE = 75  # a node asks its restart loop (Kubernetes, a supervisor) to start it again: a roll-back


class Lifecycle(ABC):
    """Mixin: the `start` / `wait_ready` / `stop` shape above, and the context manager on top of it."""

    @abstractmethod
    def start(self) -> Any:
        """Start the threads and processes; see the module docstring."""

    @abstractmethod
    def wait_ready(self, timeout: float) -> None:
        """Block until ready (at most `timeout` seconds); raise if the start failed or took longer."""

    @abstractmethod
    def stop(self, grace: float = 2.0) -> None:
        """Stop (idempotent, any thread); see the module docstring."""

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()  # whatever the failed start left running
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class ReadyFlag:
    """A start's outcome, for `wait_ready`: set once ready, or failed with the error that stopped it.

    Thread-safe; the first of `set` / `fail` wins.
    """

    def __init__(self, what: str, error: type[ParamServerError] = UnavailableError) -> None:
        self.what = what  # for the timeout message: "ps 0", "loader 1234", ...
        self.detail = ""  # the owner's latest problem on the way to ready, added to the timeout message
        self._error = error
        self._event = threading.Event()
        self._failure: BaseException | None = None
        self._lock = threading.Lock()

    def set(self) -> None:
        with self._lock:
            self._event.set()

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if not self._event.is_set():
                self._failure = exc
                self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set() and self._failure is None

    def wait(self, timeout: float) -> None:
        if not self._event.wait(timeout):
            detail = self.detail
            raise self._error(f"{self.what} not ready within {timeout:.1f}s" + (f" ({detail})" if detail else ""))
        if self._failure is not None:
            raise self._failure
