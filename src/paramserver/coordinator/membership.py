"""Membership, global step and barriers: the coordinator's state, without any transport.

A worker joins, sends heartbeats carrying its step, and leaves when done. A member silent
for longer than `heartbeat_timeout_s` counts as gone. The global step is the sum of the
members' reported steps (every worker step is one update in async mode). A barrier opens
when every live member has arrived at it. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from ..errors import DeadlineExceededError, InvalidArgumentError

log = logging.getLogger(__name__)


@dataclass
class Member:
    worker: int
    step: int = 0
    last_seen: float = 0.0
    left: bool = False


class Coordinator:
    """The cluster's membership for `num_workers` workers."""

    def __init__(self, num_workers: int, heartbeat_timeout_s: float = 30.0, clock=time.monotonic) -> None:
        self.num_workers = num_workers
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._members: dict[int, Member] = {}
        self._barriers: dict[str, set[int]] = {}
        self._opened: set[str] = set()
        self._checkpoints_requested = 0  # timed checkpoints asked for by the chief so far
        self._cond = threading.Condition()

    def join(self, worker: int) -> dict:
        self._check(worker)
        with self._cond:
            member = self._members.get(worker)
            if member is None or member.left:
                self._members[worker] = Member(worker, member.step if member else 0, self._clock())
                log.info("coordinator: worker %d joined", worker)
            self._cond.notify_all()
            return self._view()

    def heartbeat(self, worker: int, step: int) -> dict:
        self._check(worker)
        with self._cond:
            member = self._members.setdefault(worker, Member(worker))
            member.step, member.last_seen, member.left = max(member.step, step), self._clock(), False
            self._cond.notify_all()
            return self._view()

    def leave(self, worker: int) -> dict:
        self._check(worker)
        with self._cond:
            if worker in self._members:
                self._members[worker].left = True
            self._cond.notify_all()
            return self._view()

    def barrier(self, name: str, worker: int, timeout: float) -> dict:
        """Block until every expected worker has arrived at barrier `name` (or it already opened):
        the live ones and those that have not joined yet."""
        self._check(worker)
        with self._cond:
            self._barriers.setdefault(name, set()).add(worker)
            self._cond.notify_all()
            deadline = self._clock() + timeout
            while not self._barrier_open(name):  # re-checked each second: a silent member times out
                if self._clock() >= deadline:
                    waiting = sorted(self._expected() - self._barriers[name])
                    raise DeadlineExceededError(
                        f"barrier {name!r}: workers {waiting} did not arrive in {timeout:.0f}s")
                self._cond.wait(min(1.0, max(0.01, deadline - self._clock())))
            return self._view()

    def _barrier_open(self, name: str) -> bool:
        # a worker that has not joined yet is still expected (it may just start slowly);
        # one that left, or joined and went silent, is not
        if name in self._opened or self._expected() <= self._barriers[name]:
            self._opened.add(name)
            return True
        return False

    def _expected(self) -> set[int]:
        return self._live() | (set(range(self.num_workers)) - set(self._members))

    def _live(self) -> set[int]:
        now = self._clock()
        return {m.worker for m in self._members.values()
                if not m.left and now - m.last_seen <= self.heartbeat_timeout_s}

    def request_checkpoint(self, worker: int) -> dict:
        """Ask every worker to meet for a checkpoint after its current step (they learn it from the view)."""
        self._check(worker)
        with self._cond:
            self._checkpoints_requested += 1
            self._cond.notify_all()
            return self._view()

    def _view(self) -> dict:
        return {"global_step": sum(m.step for m in self._members.values()),
                "live": sorted(self._live()), "workers": self.num_workers,
                "checkpoints_requested": self._checkpoints_requested}

    def view(self) -> dict:
        with self._cond:
            return self._view()

    def all_done(self) -> bool:
        """Every worker joined once and is gone now (left, or silent past the heartbeat timeout)."""
        with self._cond:
            return len(self._members) == self.num_workers and not self._live()

    def _check(self, worker: int) -> None:
        if not isinstance(worker, int) or not 0 <= worker < self.num_workers:
            raise InvalidArgumentError(f"worker {worker!r} is outside the cluster's {self.num_workers} workers")
