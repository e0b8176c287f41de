"""Waiting in tests: poll a condition until a generous deadline, never a fixed sleep or join bound.

A condition that holds returns at once, so the deadline costs nothing when all is well; it only bounds
how long a broken run hangs, and is generous enough that a loaded machine never decides a verdict.
A condition never reached fails the test naming what it waited for."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEADLINE_S = 60.0


def wait_until(condition: Callable[[], T], what: str, timeout: float = DEADLINE_S, interval: float = 0.01) -> T:
    """Polls `condition` until it returns something true, and returns that; fails the test with
    "timed out after N s waiting for <what>" when `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def finished(thread: threading.Thread, what: str, timeout: float = DEADLINE_S) -> None:
    """Waits for `thread` to end (polling its join); fails naming `what` if it is still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while thread.is_alive():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} "
                                 f"(thread {thread.name} still running)")
        thread.join(min(0.05, max(0.0, deadline - time.monotonic())))
