"""Membership, global step and barriers: the coordinator's state, without any transport.

Every worker of the cluster is a member, in one of these states:

- ``joining``: not joined yet (it may just start slowly); awaited everywhere.
- ``training``: joined, and heard from within `heartbeat_timeout_s`.
- ``finished``: its data is done (it left every quorum); still awaited at barriers.
- ``exited``: it left the cluster (its script ended); awaited nowhere.
- ``dead``: silent for longer than `heartbeat_timeout_s` while training. A restart that joins
  again brings it back; until then it is gone for good: a barrier that needs it fails at once,
  naming it. A finished member that goes silent counts as exited (its work is done).
- ``absent``: an elastic run's slot that no worker holds yet (docs/elastic.md).

In an elastic run (`elastic`) workers join and leave while the others train: a slot nobody joined
is absent, and nothing waits for an absent, exited or dead worker, nor for one that joined after a
barrier began (it meets the next one): a worker that leaves or dies costs the others at most the
heartbeat timeout. Joins and leaves are kept as `events`, with their times.

A barrier opens once every member that is not exited has arrived (not finished either, for the
pauses that only training workers reach: checkpoints and mode switches). Waits are long polls of at
most `wait_s` each, so that no call's deadline fails a peer that is alive and merely slow. A
barrier that has not opened after half the heartbeat timeout is logged with who arrived and where
each missing worker is (again after twice as long each time); one that can never open (its missing
workers wait at barriers that wait for it) fails, naming them (coordinator/barriers.py).

Checkpoints are decided here, whatever asked for them (the chief's step count or clock, or a
RequestCheckpoint call): `request_checkpoint` announces checkpoint number k in every view
("checkpoints_requested"), and every worker meets at the same barrier, "checkpoint#k", after the
step at which it learns of it. A request while checkpoint k is announced and not yet written
(its "checkpoint#k:written" barrier has not opened) merges into it: no worker has trained a step
since its barrier, so it would write the same state.
The global step is the sum of the members' reported steps.

The coordinator also owns the data positions of a run whose script hands its data to it (`split`,
coordinator/dispatcher.py): a worker reports its position with its heartbeats, at barriers and when
it leaves; one that leaves or dies has its split taken back at the last position it reported
(coordinator/handout.py). Lock order: the coordinator's, then the handout's. Thread-safe.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass

from paramserver.base.deadline import Deadline
from paramserver.base.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from paramserver.coordinator.barriers import Barriers
from paramserver.coordinator.handout import Handout, Position

log = logging.getLogger(__name__)
_INT64 = 1 << 63
# a Barrier call is a long poll of a few seconds (the client asks again): a longer one would only let a
# caller hold one of the coordinator's few request threads
MAX_BARRIER_WAIT_S = 60
STATES = ("joining", "training", "finished", "exited", "dead", "absent")
MAX_EVENTS = 1000  # joins and leaves kept (the oldest dropped first)


@dataclass
class Member:
    worker: int
    step: int = 0
    last_seen: float = 0.0
    joined: bool = False
    finished: bool = False
    exited: bool = False
    reported_gone: bool = False  # `newly_gone` told the caller already
    joined_at: float = 0.0  # the latest join (an elastic barrier does not wait for a worker that joined after it began)
    gone_why: str | None = None  # why it counts as dead before the heartbeat timeout (caller_gone)
    polls: int = 0  # its heartbeats held now (long polls): only such a call, once cancelled, says it is gone


def checkpoint_barrier(number: int) -> str:
    """The barrier where every worker meets for the `number`-th checkpoint the coordinator announced."""
    return f"checkpoint#{number}"


class Coordinator:
    """The cluster's membership for `num_workers` workers."""

    def __init__(
        self, num_workers: int, heartbeat_timeout_s: float = 30.0, clock=time.monotonic, elastic: bool = False
    ) -> None:
        """`num_workers`: the cluster's workers, or an elastic run's slots (`elastic`)."""
        self.num_workers = num_workers
        self.elastic = elastic
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.events: list[dict] = []  # joins and leaves: {"t": seconds since start, "worker", "event"}
        self._clock = clock
        self._members = {worker: Member(worker) for worker in range(num_workers)}
        self._barriers = Barriers()
        self._checkpoints_requested = 0  # checkpoints announced so far (the last one may be under way)
        self._published: dict[str, str] = {}  # what the hosting worker tells the others (rendezvous addresses)
        self._started = clock()
        self._cond = threading.Condition()
        self.gone_found = threading.Event()  # set by `caller_gone`: the host's watcher tells the shards now
        self.handout = Handout(clock)  # the data positions, when the script hands its data out (`split`)
        self.incarnation = secrets.token_hex(8)  # a restarted chief's coordinator is another: workers roll back

    # ---- a member's own calls ----------------------------------------------------------------
    def join(self, worker: int) -> dict:
        """A worker starts, or starts again after a restart: it is training."""
        self._check(worker)
        with self._cond:
            member = self._members[worker]
            again = member.joined
            was = self._state(member)
            member.joined, member.finished, member.exited, member.reported_gone = True, False, False, False
            member.last_seen = member.joined_at = self._clock()
            member.gone_why = None
            self._barriers.forget(worker)  # a restarted worker waits nowhere yet
            self._event(worker, "joined" if was in ("joining", "absent", "exited") else "rejoined")
            log.log(
                logging.INFO if self.elastic else logging.DEBUG,
                "coordinator: worker %d %s",
                worker,
                "joined again" if again else "joined",
            )
            self._cond.notify_all()
            return self._view()

    def heartbeat(
        self, worker: int, step: int, wait_s: float = 0.0, checkpoints: int = 0, position: Position | None = None
    ) -> dict:
        """The worker is alive at `step` (and at `position` of the data it was handed). `wait_s`: hold
        the reply until a checkpoint after the `checkpoints`-th is announced, or at most `wait_s`
        seconds (a long poll)."""
        self._check(worker)
        if type(step) is not int or not 0 <= step < _INT64:
            raise InvalidArgumentError(f"worker {worker}: heartbeat step must be a non-negative int64, got {step!r}")
        if not 0 <= wait_s <= MAX_BARRIER_WAIT_S:  # also refuses NaN
            raise InvalidArgumentError(f"heartbeat wait must be between 0 and {MAX_BARRIER_WAIT_S} s, got {wait_s!r}")
        lost = self.handout.report(worker, position)
        view = {**self._heard(worker, step), **lost}
        if lost:
            return view
        if wait_s <= 0 or view["checkpoints_requested"] > checkpoints:
            return view
        deadline = Deadline(wait_s)
        with self._cond:
            member = self._members[worker]
            member.polls += 1
            try:
                while self._checkpoints_requested <= checkpoints and not deadline.passed() and not member.exited:
                    self._cond.wait(deadline.left())
            finally:
                member.polls -= 1
            return self._view()

    def _heard(self, worker: int, step: int) -> dict:
        with self._cond:
            member = self._members[worker]
            if not member.joined:  # a coordinator that started again after this worker joined
                member.joined = True
            if self._state(member) == "dead":  # it was only stalled: if it dies later, report it again
                member.reported_gone = False
                log.warning(
                    "coordinator: worker %d is heard from again after %.0fs", worker, self._clock() - member.last_seen
                )
            member.step, member.last_seen, member.gone_why = max(member.step, step), self._clock(), None
            self._cond.notify_all()
            return self._view()

    def finish(self, worker: int) -> dict:
        """The worker's data is done; it may still meet the others at barriers."""
        self._check(worker)
        with self._cond:
            member = self._members[worker]
            member.finished, member.last_seen = True, self._clock()
            log.debug("coordinator: worker %d finished its data", worker)  # the worker says it at INFO
            self._cond.notify_all()
            return self._view()

    def leave(self, worker: int, position: Position | None = None) -> dict:
        """The worker's script ended, or it left an elastic run: nothing waits for it any more, and the
        split it held goes back at `position`."""
        self._check(worker)
        self.handout.report(worker, position)
        self.handout.release(worker)
        with self._cond:
            member = self._members[worker]
            if not member.exited:
                self._event(worker, "left")
            member.exited = True
            self._barriers.forget(worker)
            self._cond.notify_all()
            return self._view()

    def barrier(
        self, name: str, worker: int, wait_s: float, training_only: bool = False, position: Position | None = None
    ) -> dict:
        """Arrive at barrier `name` and wait at most `wait_s` for it to open. The view returned
        says "open" and, if not, the workers still "waiting"; the caller asks again.

        A barrier waits for every member that has not exited; a `training_only` one (the pauses
        for checkpoints and mode switches, which a worker past its data never reaches) does not
        wait for finished members. Raises UnavailableError at once when a worker it needs is dead,
        and FailedPreconditionError, naming who waits where, when it can never open.
        """
        self._check(worker)
        if not 0 <= wait_s <= MAX_BARRIER_WAIT_S:  # also refuses NaN
            raise InvalidArgumentError(f"barrier wait must be between 0 and {MAX_BARRIER_WAIT_S} s, got {wait_s!r}")
        lost = self.handout.report(worker, position)  # before it arrives: a checkpoint's cut records exact positions
        if lost:
            return {**self.view(), **lost, "open": False, "waiting": []}
        with self._cond:
            now = self._clock()
            deadline = now + wait_s
            self._barriers.arrive(name, worker, training_only, now, deadline)
            self._cond.notify_all()
            announced = self._checkpoints_requested
            while not self._barrier_open(name, training_only):
                self._fail_if_dead(name, training_only)
                self._fail_if_stuck(name, training_only)
                left = deadline - self._clock()
                # a checkpoint announced meanwhile: a worker waiting elsewhere hears of it now, to meet it
                interrupted = announced != self._checkpoints_requested and not name.startswith("checkpoint")
                if left <= 0 or interrupted:
                    return {**self._view(), "open": False, "waiting": self._missing(name, training_only)}
                self._cond.wait(min(1.0, left))  # re-checked each second: a silent member dies
            return {**self._view(), "open": True}

    def request_checkpoint(self, worker: int) -> dict:
        """Announce a checkpoint: every worker meets at its barrier after the step at which it learns
        of it (from any reply). Returns the view, which names it ("checkpoints_requested").

        Requests merge: while the last checkpoint is announced and not yet written, another changes
        nothing (the workers meet once for both), so neither a burst nor two triggers at once
        (the chief's step count and its clock) can make workers wait at different barriers."""
        self._check(worker)
        with self._cond:
            if not self._checkpoint_pending():
                self._checkpoints_requested += 1
                log.debug(  # the chief says at INFO when it is written
                    "coordinator: checkpoint #%d announced (asked by worker %d)", self._checkpoints_requested, worker
                )
            self._cond.notify_all()
            return self._view()

    # ---- the data (coordinator/handout.py) -----------------------------------------------------
    def split(
        self, worker: int, num_splits: int, epochs: int, done: Position | None = None, wait_s: float = 0.0
    ) -> dict:
        """The next split for `worker` (`split` in the view: [epoch, split, position]), after it finished
        `done`; the first call describes the data. With none to hand out, waits at most `wait_s` for
        one taken back; then `data_done` says whether every split is done (else others hold the last)."""
        self._check(worker)
        if not 0 <= wait_s <= MAX_BARRIER_WAIT_S:  # also refuses NaN
            raise InvalidArgumentError(f"split wait must be between 0 and {MAX_BARRIER_WAIT_S} s, got {wait_s!r}")
        answer = self.handout.split(worker, num_splits, epochs, done, wait_s)
        return {**self.view(), **answer}

    @property
    def dispatcher(self):
        """Who holds which split, and the positions (coordinator/dispatcher.py; monitoring and tests)."""
        return self.handout.dispatcher

    def data_state(self) -> dict | None:
        """The dispatcher's record for a checkpoint (None when the script hands out no data)."""
        return self.handout.state()

    def hold_data(self) -> None:
        """Hand out no split until `restore_data` (the chief learns which checkpoint the run resumed from)."""
        self.handout.hold()

    def restore_data(self, state: object) -> None:
        """Continue the data from a checkpoint's record (None: a fresh start); see Handout.restore."""
        self.handout.restore(state)

    # ---- what the host asks ------------------------------------------------------------------
    def publish(self, key: str, value: str) -> None:
        """Tell every worker `value` under `key`, in every view from now on (e.g. where the dense
        all-reduce meets: optim/dense_sync.py)."""
        with self._cond:
            self._published[key] = value
            self._cond.notify_all()

    def state(self, worker: int) -> str:
        with self._cond:
            return self._state(self._members[worker])

    def view(self) -> dict:
        with self._cond:
            return self._view()

    def caller_gone(self, worker: int) -> None:
        """`worker`'s heartbeat, held here, was cancelled by its caller (its connection closed): in an
        elastic run it is dead now, not after the heartbeat timeout (`newly_gone` reports it); a heartbeat
        from it brings it back. Not in a fixed run, where a worker found dead fails the barriers that need it."""
        with self._cond:
            member = self._members.get(worker)
            # a held heartbeat passed the caller's checks (its token's role and worker): no other call can drop it
            if not self.elastic or member is None or not member.polls or self._state(member) != "training":
                return
            member.last_seen = self._clock() - self.heartbeat_timeout_s - 1.0
            member.gone_why = "its heartbeat's connection closed"
            log.info("coordinator: worker %d: its heartbeat's connection closed; it is gone", worker)
            self._cond.notify_all()
        self.gone_found.set()

    def newly_gone(self) -> list[tuple[int, str]]:
        """Members found dead since the last call, with why: for the host to tell the shards."""
        with self._cond:
            found = []
            for member in self._members.values():
                if self._state(member) == "dead" and not member.reported_gone:
                    member.reported_gone = True
                    found.append((member.worker, self._why_dead(member)))
                    self._event(member.worker, "died")
            for worker, _ in found:
                self.handout.release(worker)
            return found

    def all_done(self, joining_grace_s: float = 0.0) -> bool:
        """No worker may need the coordinator any more: every one exited or is dead, and those that
        never joined were given `joining_grace_s` since the coordinator started."""
        with self._cond:
            states = [self._state(m) for m in self._members.values()]
            waiting_to_join = "joining" in states and self._clock() - self._started < joining_grace_s
            return not waiting_to_join and all(s in ("exited", "dead", "joining", "absent") for s in states)

    def wait_all_done(self, joining_grace_s: float, poll_s: float = 1.0) -> None:
        """Block until `all_done`: while any worker is alive, however long it takes."""
        with self._cond:
            while not self.all_done(joining_grace_s):
                self._cond.wait(poll_s)

    # ---- internals ---------------------------------------------------------------------------
    def _state(self, member: Member) -> str:
        if not member.joined:
            return "absent" if self.elastic and member.worker != 0 else "joining"
        if member.exited:
            return "exited"
        if self._clock() - member.last_seen > self.heartbeat_timeout_s:
            return "exited" if member.finished else "dead"
        return "finished" if member.finished else "training"

    def _why_dead(self, member: Member) -> str:
        if member.gone_why is not None:
            return member.gone_why
        return f"no heartbeat for {self._clock() - member.last_seen:.0f}s, and it has not joined again"

    def _checkpoint_pending(self) -> bool:
        number = self._checkpoints_requested
        return number > 0 and f"{checkpoint_barrier(number)}:written" not in self._barriers.opened

    def _missing(self, name: str, training_only: bool | None = None) -> list[int]:
        if training_only is None:
            training_only = self._barriers.training_only.get(name, False)
        arrived = self._barriers.arrived.get(name, set())
        skipped: tuple[str, ...] = ("exited", "absent", "finished") if training_only else ("exited", "absent")
        if self.elastic:  # nothing waits for a worker that died, nor for one that joined after the barrier began
            skipped += ("dead",)
            began = self._barriers.started.get(name, self._clock())
            return [
                m.worker
                for m in self._members.values()
                if m.worker not in arrived and self._state(m) not in skipped and m.joined_at <= began
            ]
        return [m.worker for m in self._members.values() if m.worker not in arrived and self._state(m) not in skipped]

    def _barrier_open(self, name: str, training_only: bool) -> bool:
        if name in self._barriers.opened:
            return True
        if self._missing(name, training_only):
            return False
        self._barriers.open(name)
        return True

    def _fail_if_dead(self, name: str, training_only: bool) -> None:
        for worker in self._missing(name, training_only):
            member = self._members[worker]
            if self._state(member) == "dead":
                raise UnavailableError(f"barrier {name!r}: worker {worker} is gone ({self._why_dead(member)})")

    def _fail_if_stuck(self, name: str, training_only: bool) -> None:
        """Fail barrier `name`, and every barrier it waits on, once none of them can ever open (within
        half the heartbeat timeout); else say why it has not opened, after half the heartbeat timeout
        and again after twice as long each time."""
        if name in self._barriers.failed:
            raise FailedPreconditionError(self._barriers.failed[name])
        now, patience = self._clock(), self.heartbeat_timeout_s / 2
        if now - self._barriers.started[name] < patience:
            return
        cycle = self._barriers.cycle(name, self._missing, now, patience)
        if cycle is not None:
            why = "; ".join(self._barriers.describe(b, missing, self._whereabouts) for b, missing in cycle.items())
            message = f"barriers that can never open (each waits for workers waiting at another): {why}"
            log.error("coordinator: %s", message)
            for barrier in cycle:
                self._barriers.failed[barrier] = message
            self._cond.notify_all()
            raise FailedPreconditionError(message)
        if self._barriers.due_report(name, now, patience):
            log.info(
                "coordinator: %s, after %.0fs",
                self._barriers.describe(name, self._missing(name, training_only), self._whereabouts),
                now - self._barriers.started[name],
            )

    def _whereabouts(self, worker: int) -> str:
        """Where `worker` is: at a barrier (since when), or what it does."""
        member, now = self._members[worker], self._clock()
        waiting = self._barriers.waiting_at(worker, now)
        if waiting is not None:
            return f"waits at {waiting.barrier!r} for {now - waiting.since:.0f}s"
        state = self._state(member)
        if state == "joining":
            return "has not joined"
        return f"{state} at step {member.step}, heard from {now - member.last_seen:.0f}s ago"

    def _live(self) -> list[int]:
        return [m.worker for m in self._members.values() if self._state(m) in ("training", "finished")]

    def _event(self, worker: int, what: str) -> None:
        """Record a join or a leave (call under `_cond`)."""
        self.events.append({"t": round(self._clock() - self._started, 3), "worker": worker, "event": what})
        del self.events[:-MAX_EVENTS]

    def hello(self) -> dict:
        """The view, and in an elastic run the joins and leaves so far (`paramserver status`)."""
        with self._cond:
            if not self.elastic:
                return self._view()
            events = [[e["t"], e["worker"], e["event"]] for e in self.events]
            return {**self._view(), "elastic": True, "events": events}

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
