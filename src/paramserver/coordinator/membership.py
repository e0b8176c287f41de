"""Membership, global step and barriers: the coordinator's state, without any transport.

Every worker of the cluster is a member, in one of these states:

- ``joining``: not joined yet (it may just start slowly); awaited everywhere.
- ``training``: joined, and heard from within `heartbeat_timeout_s`.
- ``finished``: its data is done (it left every quorum); still awaited at barriers.
- ``exited``: it left the cluster (its script ended); awaited nowhere.
- ``dead``: silent for longer than `heartbeat_timeout_s` while training. A restart that joins
  again brings it back; until then it is gone for good: a barrier that needs it fails at once,
  naming it. A finished member that goes silent counts as exited (its work is done).

A barrier opens once every member that is not exited has arrived (not finished either, for the
pauses that only training workers reach: checkpoints and mode switches). Waits are long polls of at
most `wait_s` each, so that no call's deadline fails a peer that is alive and merely slow.
The global step is the sum of the members' reported steps. Thread-safe.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass

from ..base.errors import InvalidArgumentError, UnavailableError

log = logging.getLogger(__name__)
_INT64 = 1 << 63
# a Barrier call is a long poll of a few seconds (the client asks again): a longer one would only let a
# caller hold one of the coordinator's few request threads
MAX_BARRIER_WAIT_S = 60
STATES = ("joining", "training", "finished", "exited", "dead")
_STEP_PAUSE = re.compile(r"^checkpoint@(\d+)(:written)?$")  # the pauses of checkpoint_every


@dataclass
class Member:
    worker: int
    step: int = 0
    last_seen: float = 0.0
    joined: bool = False
    finished: bool = False
    exited: bool = False
    reported_gone: bool = False  # `newly_gone` told the caller already


def timed_checkpoint_barrier(request: int) -> str:
    """The barrier where the workers meet for the chief's `request`-th timed checkpoint."""
    return f"checkpoint#{request}"


class Coordinator:
    """The cluster's membership for `num_workers` workers."""

    def __init__(self, num_workers: int, heartbeat_timeout_s: float = 30.0, clock=time.monotonic) -> None:
        self.num_workers = num_workers
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._members = {worker: Member(worker) for worker in range(num_workers)}
        self._barriers: dict[str, set[int]] = {}
        self._opened: set[str] = set()
        self._checkpoints_requested = 0  # timed checkpoints asked for by the chief so far
        self._published: dict[str, str] = {}  # what the hosting worker tells the others (rendezvous addresses)
        self._started = clock()
        self._cond = threading.Condition()
        self.incarnation = secrets.token_hex(8)  # a restarted chief's coordinator is another: workers roll back

    # ---- a member's own calls ----------------------------------------------------------------
    def join(self, worker: int) -> dict:
        """A worker starts, or starts again after a restart: it is training."""
        self._check(worker)
        with self._cond:
            member = self._members[worker]
            again = member.joined
            member.joined, member.finished, member.exited, member.reported_gone = True, False, False, False
            member.last_seen = self._clock()
            log.info("coordinator: worker %d %s", worker, "joined again" if again else "joined")
            self._cond.notify_all()
            return self._view()

    def heartbeat(self, worker: int, step: int) -> dict:
        self._check(worker)
        if type(step) is not int or not 0 <= step < _INT64:
            raise InvalidArgumentError(f"worker {worker}: heartbeat step must be a non-negative int64, got {step!r}")
        with self._cond:
            member = self._members[worker]
            if not member.joined:  # a coordinator that started again after this worker joined
                member.joined = True
            if self._state(member) == "dead":  # it was only stalled: if it dies later, report it again
                member.reported_gone = False
                log.warning(
                    "coordinator: worker %d is heard from again after %.0fs", worker, self._clock() - member.last_seen
                )
            member.step, member.last_seen = max(member.step, step), self._clock()
            self._cond.notify_all()
            return self._view()

    def finish(self, worker: int) -> dict:
        """The worker's data is done; it may still meet the others at barriers."""
        self._check(worker)
        with self._cond:
            member = self._members[worker]
            member.finished, member.last_seen = True, self._clock()
            log.info("coordinator: worker %d finished its data", worker)
            self._cond.notify_all()
            return self._view()

    def leave(self, worker: int) -> dict:
        """The worker's script ended: nothing waits for it any more."""
        self._check(worker)
        with self._cond:
            self._members[worker].exited = True
            self._cond.notify_all()
            return self._view()

    def barrier(self, name: str, worker: int, wait_s: float, training_only: bool = False) -> dict:
        """Arrive at barrier `name` and wait at most `wait_s` for it to open. The view returned
        says "open" and, if not, the workers still "waiting"; the caller asks again.

        A barrier waits for every member that has not exited; a `training_only` one (the pauses
        for checkpoints and mode switches, which a worker past its data never reaches) does not
        wait for finished members. Raises UnavailableError at once when a worker it needs is dead.
        """
        self._check(worker)
        if not 0 <= wait_s <= MAX_BARRIER_WAIT_S:  # also refuses NaN
            raise InvalidArgumentError(f"barrier wait must be between 0 and {MAX_BARRIER_WAIT_S} s, got {wait_s!r}")
        with self._cond:
            self._barriers.setdefault(name, set()).add(worker)
            self._cond.notify_all()
            deadline = self._clock() + wait_s
            while not self._barrier_open(name, training_only):
                self._fail_if_dead(name, training_only)
                left = deadline - self._clock()
                if left <= 0:
                    return {**self._view(), "open": False, "waiting": self._missing(name, training_only)}
                self._cond.wait(min(1.0, left))  # re-checked each second: a silent member dies
            return {**self._view(), "open": True}

    def request_checkpoint(self, worker: int) -> dict:
        """Ask every worker to meet for a checkpoint after its current step (they learn it from the view).

        Requests coalesce: while the last one's barrier has not opened, another changes nothing (the
        workers meet once for both), so a burst cannot make workers wait at different barriers."""
        self._check(worker)
        with self._cond:
            pending = (
                self._checkpoints_requested
                and timed_checkpoint_barrier(self._checkpoints_requested) not in self._opened
            )
            if not pending:
                self._checkpoints_requested += 1
            self._cond.notify_all()
            return self._view()

    # ---- what the host asks ------------------------------------------------------------------
    def publish(self, key: str, value: str) -> None:
        """Tell every worker `value` under `key`, in every view from now on (e.g. where the dense
        all-reduce meets: worker/dense_sync.py)."""
        with self._cond:
            self._published[key] = value
            self._cond.notify_all()

    def state(self, worker: int) -> str:
        with self._cond:
            return self._state(self._members[worker])

    def view(self) -> dict:
        with self._cond:
            return self._view()

    def newly_gone(self) -> list[tuple[int, str]]:
        """Members found dead since the last call, with why: for the host to tell the shards."""
        with self._cond:
            found = []
            for member in self._members.values():
                if self._state(member) == "dead" and not member.reported_gone:
                    member.reported_gone = True
                    found.append((member.worker, self._why_dead(member)))
            return found

    def all_done(self, joining_grace_s: float = 0.0) -> bool:
        """No worker may need the coordinator any more: every one exited or is dead, and those that
        never joined were given `joining_grace_s` since the coordinator started."""
        with self._cond:
            states = [self._state(m) for m in self._members.values()]
            waiting_to_join = "joining" in states and self._clock() - self._started < joining_grace_s
            return not waiting_to_join and all(s in ("exited", "dead", "joining") for s in states)

    def wait_all_done(self, joining_grace_s: float, poll_s: float = 1.0) -> None:
        """Block until `all_done`: while any worker is alive, however long it takes."""
        with self._cond:
            while not self.all_done(joining_grace_s):
                self._cond.wait(poll_s)

    # ---- internals ---------------------------------------------------------------------------
    def _state(self, member: Member) -> str:
        if not member.joined:
            return "joining"
        if member.exited:
            return "exited"
        if self._clock() - member.last_seen > self.heartbeat_timeout_s:
            return "exited" if member.finished else "dead"
        return "finished" if member.finished else "training"

    def _why_dead(self, member: Member) -> str:
        return f"no heartbeat for {self._clock() - member.last_seen:.0f}s, and it has not joined again"

    def _missing(self, name: str, training_only: bool) -> list[int]:
        arrived = self._barriers.get(name, set())
        skipped = ("exited", "finished") if training_only else ("exited",)
        return [m.worker for m in self._members.values() if m.worker not in arrived and self._state(m) not in skipped]

    def _barrier_open(self, name: str, training_only: bool) -> bool:
        missing = self._missing(name, training_only)
        if name in self._opened or not missing or training_only and self._passed_by(name, missing):
            self._opened.add(name)
            return True
        return False

    def _passed_by(self, name: str, missing: list[int]) -> bool:
        """Whether every missing worker waits at a later step's checkpoint pause: this one's checkpoint
        was written before this coordinator started (its chief restarted), and a worker that resumed
        behind the others reaches it alone. It goes on, to meet them at theirs."""
        match = _STEP_PAUSE.match(name)
        if match is None:
            return False
        later = {
            worker
            for barrier, arrived in self._barriers.items()
            if barrier not in self._opened
            and (other := _STEP_PAUSE.match(barrier))
            and int(other.group(1)) > int(match.group(1))
            for worker in arrived
        }
        return all(worker in later for worker in missing)

    def _fail_if_dead(self, name: str, training_only: bool) -> None:
        for worker in self._missing(name, training_only):
            member = self._members[worker]
            if self._state(member) == "dead":
                raise UnavailableError(f"barrier {name!r}: worker {worker} is gone ({self._why_dead(member)})")

    def _live(self) -> list[int]:
        return [m.worker for m in self._members.values() if self._state(m) in ("training", "finished")]

    def _view(self) -> dict:
        return {
            "global_step": sum(m.step for m in self._members.values()),
            "live": self._live(),
            "workers": self.num_workers,
            "states": {str(m.worker): self._state(m) for m in self._members.values()},
            "steps": {str(m.worker): m.step for m in self._members.values()},
            "checkpoints_requested": self._checkpoints_requested,
            "incarnation": self.incarnation,
            **({"published": dict(self._published)} if self._published else {}),
        }

    def _check(self, worker: int) -> None:
        if not isinstance(worker, int) or isinstance(worker, bool) or not 0 <= worker < self.num_workers:
            raise InvalidArgumentError(f"worker {worker!r} is outside the cluster's {self.num_workers} workers")
