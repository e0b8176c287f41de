"""The coordinator's barriers: who arrived where, which opened, and where each worker waits now.

A barrier that does not open says why. Once it has waited `patience` seconds (half the heartbeat
timeout), and again after twice as long each time, the coordinator logs who arrived and, for each
missing worker, where it is: waiting at another barrier (and since when), or training at its last
reported step. When the missing
workers wait at other barriers that themselves wait, in turn, only for workers waiting at
barriers, nobody can arrive anywhere: every barrier of that cycle is failed, naming who waits
where, so that each worker's wait ends with the reason instead of lasting for ever.

Not thread-safe: the Coordinator calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

# a worker between two polls of the same barrier still waits there: it asks again at once, so a
# poll that ended this long ago without another one means it went on (e.g. its own timeout)
POLL_SLACK_S = 2.0


@dataclass
class Waiting:
    barrier: str
    since: float  # when it arrived there
    until: float  # the end of its current poll: it waits there until then, and asks again


class Barriers:
    def __init__(self) -> None:
        self.arrived: dict[str, set[int]] = {}
        self.opened: set[str] = set()
        self.training_only: dict[str, bool] = {}  # as the first arrival asked
        self.started: dict[str, float] = {}  # first arrival
        self.at: dict[int, Waiting] = {}  # where each worker waits now
        self.failed: dict[str, str] = {}  # barriers that cannot open, with why
        self._reported: dict[str, tuple[float, float]] = {}  # a barrier's last report: when, and the wait to the next

    def arrive(self, name: str, worker: int, training_only: bool, now: float, until: float) -> None:
        self.arrived.setdefault(name, set()).add(worker)
        self.training_only.setdefault(name, training_only)
        self.started.setdefault(name, now)
        current = self.at.get(worker)
        since = current.since if current is not None and current.barrier == name else now
        self.at[worker] = Waiting(name, since, until)

    def open(self, name: str) -> None:
        self.opened.add(name)
        for worker in [w for w, waiting in self.at.items() if waiting.barrier == name]:
            del self.at[worker]

    def forget(self, worker: int) -> None:
        """`worker` joined again (a restart) or left: it waits nowhere now."""
        self.at.pop(worker, None)

    def waiting_at(self, worker: int, now: float) -> Waiting | None:
        """Where `worker` waits now: a barrier not open that it polls (None: it does not wait)."""
        waiting = self.at.get(worker)
        if waiting is None or waiting.barrier in self.opened or now > waiting.until + POLL_SLACK_S:
            return None
        return waiting

    def due_report(self, name: str, now: float, patience: float) -> bool:
        """Whether barrier `name` is to be reported now: `patience` seconds after it started, then
        after twice as long as the time before (a worker with more data is waited for, and said so
        a few times, not every few seconds)."""
        last, gap = self._reported.get(name, (self.started.get(name, now), patience))
        if now - last < gap:
            return False
        self._reported[name] = (now, 2 * gap)
        return True

    def cycle(
        self, name: str, missing: Callable[[str], list[int]], now: float, patience: float
    ) -> dict[str, list[int]] | None:
        """The barriers, from `name` on, that wait only for workers waiting (for `patience` seconds
        at least) at another barrier of the same set, with the workers each misses; None when some
        missing worker is not waiting so (it may still arrive)."""
        found: dict[str, list[int]] = {}
        todo = [name]
        while todo:
            barrier = todo.pop()
            if barrier in found:
                continue
            found[barrier] = missing(barrier)
            for worker in found[barrier]:
                waiting = self.waiting_at(worker, now)
                if waiting is None or waiting.barrier == barrier or now - waiting.since < patience:
                    return None
                todo.append(waiting.barrier)
        return found

    def describe(self, name: str, missing: Iterable[int], whereabouts: Callable[[int], str]) -> str:
        """'barrier NAME: arrived [0]; missing: worker 1 (waits at 'b' for 20s)'."""
        missing = list(missing)
        text = f"barrier {name!r}: arrived {sorted(self.arrived.get(name, ()))}"
        if missing:
            text += "; missing: " + ", ".join(f"worker {w} ({whereabouts(w)})" for w in missing)
        return text
