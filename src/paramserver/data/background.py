"""Batches made in a background thread of the training process, ahead of the loop that uses them.

The Criteo parser is C called through ctypes, which lets go of the GIL while it parses, and a
worker spends much of each step in torch's kernels and in waiting for its PS, which let go of
it too: a thread then parses the next batches while the loop trains on this one, without a
second interpreter (a loader process, data/loader.py, costs ~50 MB and a pickle per batch).

Lifecycle (base/lifecycle.py): `start()` starts the thread (named `name`); `wait_ready(timeout)`
blocks until the first batch (or the end, or an error) is waiting; iterate (from one thread);
`stop(grace)` (iteration to the end, leaving early, or any thread) tells the thread to stop and
joins it. An exception raised by the source is raised again in the loop, as itself. Every wait
has a deadline: `timeout_s` for one batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from paramserver.base.errors import InvalidArgumentError, ParamServerError
from paramserver.base.lifecycle import Lifecycle, ReadyFlag

_PUT_TICK_S = 0.2  # how often a producer blocked on a full queue looks whether it was stopped


class BackgroundError(ParamServerError):
    """The background thread sent no batch in time, or was stopped."""


def queued_batches(items: queue.Queue, timeout_s: float, silent: Callable[[], Exception]) -> Iterator[Any]:
    """What a producer puts on `items` as ("batch", value), up to its ("end", None); its ("error",
    exc) is raised here as itself, and `silent()` when nothing came for `timeout_s` seconds."""
    while True:
        try:
            kind, value = items.get(timeout=timeout_s)
        except queue.Empty:
            raise silent() from None
        if kind == "end":
            return
        if kind == "error":
            raise value
        yield value


class BackgroundBatches(Lifecycle):
    """Iterates `make()` in a thread named `name`, up to `depth` items ahead (a bounded queue)."""

    def __init__(
        self,
        make: Callable[[], Iterable[Any]],
        depth: int = 4,
        timeout_s: float = 300.0,
        name: str = "batches",
    ) -> None:
        if depth < 1:
            raise InvalidArgumentError(f"background depth must be at least 1, got {depth}")
        self._make = make
        self.timeout_s = timeout_s
        self._items: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._produce, name=name, daemon=True)
        self._started = False
        self._lock = threading.Lock()
        self.ready = ReadyFlag(f"background thread {name}", BackgroundError)

    def start(self) -> BackgroundBatches:
        with self._lock:
            if self._stopping.is_set():
                raise BackgroundError("a stopped background thread cannot start again")
            if not self._started:
                self._started = True
                self._thread.start()
        return self

    def wait_ready(self, timeout: float) -> None:
        self.ready.wait(timeout)

    def __iter__(self) -> Iterator[Any]:
        self.start()
        try:
            yield from queued_batches(
                self._items,
                self.timeout_s,
                lambda: BackgroundError(f"{self._thread.name} sent no batch in {self.timeout_s:.0f}s"),
            )
        finally:
            self.stop()

    def stop(self, grace: float = 2.0) -> None:
        """Tell the thread to stop and join it (at most `grace` seconds: a batch being parsed ends
        first). Idempotent; any thread."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
        self.ready.fail(BackgroundError("background thread stopped"))
        if self._started and self._thread is not threading.current_thread():
            self._thread.join(grace)

    def _produce(self) -> None:
        items: Iterator[Any] | None = None
        try:
            items = iter(self._make())
            for item in items:
                if not self._put(("batch", item)):
                    return
        except BaseException as exc:  # handed to the loop, which raises it
            self._put(("error", exc))
            return
        finally:
            close = getattr(items, "close", None)
            if close is not None:  # a generator left early: its files close now
                close()
        self._put(("end", None))

    def _put(self, message: tuple[str, Any]) -> bool:
        """Queue `message`, waiting while the queue is full; False once stopped."""
        while not self._stopping.is_set():
            try:
                self._items.put(message, timeout=_PUT_TICK_S)
            except queue.Full:
                continue
            self.ready.set()
            return True
        return False
