"""Deadline: one time limit shared by several waits (a fan-out to every shard, a retry loop)."""

from __future__ import annotations

import time


class Deadline:
    """`left()` is the time remaining of `timeout` seconds from now, never negative."""

    def __init__(self, timeout: float) -> None:
        self.at = time.monotonic() + timeout

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return time.monotonic() >= self.at
