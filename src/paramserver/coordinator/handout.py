"""The data a script hands out, on the coordinator: the dispatcher (coordinator/dispatcher.py) behind
the calls that ask for a split, report a position or give a split back, and the long poll of a
worker waiting for a split taken back.

A worker reports its position with its heartbeats, at barriers and when it leaves; one that leaves
or dies is `release`d: its split goes back at the last position it reported. The chief holds the
handout (`hold`) until it restored the positions of the checkpoint the run resumed from (`restore`).
Thread-safe: one condition guards the hold and wakes waiting workers; the dispatcher has its own lock,
taken after it.
"""

from __future__ import annotations

import logging
import threading
import time

from paramserver.base.deadline import Deadline
from paramserver.base.errors import FailedPreconditionError, InvalidArgumentError
from paramserver.coordinator.dispatcher import Dispatcher

log = logging.getLogger(__name__)
Position = tuple[int, int, int] | list[int]  # (epoch, split, batches of it trained)


class Handout:
    """Splits handed to workers as they ask, positions as they report."""

    def __init__(self, clock=time.monotonic) -> None:
        self.dispatcher = Dispatcher(clock)
        self._held = False  # `hold`: no split goes out until a checkpoint's positions are restored
        self._cond = threading.Condition()

    def split(self, worker: int, num_splits: int, epochs: int, done: Position | None, wait_s: float) -> dict:
        """{"split": [epoch, split, position]} for `worker`, after it finished `done` (the first call
        describes the data); with none to hand out after `wait_s`, {"data_done": bool}."""
        deadline = Deadline(wait_s)
        with self._cond:
            while self._held:  # the chief restores a checkpoint's positions first
                if deadline.passed():
                    return {"data_done": False}
                self._cond.wait(min(1.0, deadline.left()))
        self.dispatcher.describe(num_splits, epochs)
        if done is not None:
            self._complete(worker, done)
        with self._cond:
            self._cond.notify_all()  # a completion may end the data: workers waiting for a split hear it
            while (assigned := self.dispatcher.acquire(worker)) is None:
                if self.dispatcher.finished or deadline.passed():
                    return {"data_done": self.dispatcher.finished}
                self._cond.wait(min(1.0, deadline.left()))
            return {"split": [assigned.epoch, assigned.split, assigned.position]}

    def state(self) -> dict | None:
        """The dispatcher's record for a checkpoint (None when the script hands out no data)."""
        return self.dispatcher.state() if self.dispatcher.described else None

    def hold(self) -> None:
        with self._cond:
            self._held = True

    def restore(self, state: object) -> None:
        """Continue the data from a checkpoint's record (None: a fresh start), and hand out splits from
        now on. A bad record raises InvalidArgumentError naming what is wrong and changes nothing: the
        data stays held (a fresh start on a checkpoint's values would train its examples again)."""
        if state is not None:
            self.dispatcher.load_state(state)
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def report(self, worker: int, position: Position | None) -> dict:
        """Record `worker`'s data position; {"split_lost": True} when its split was taken back. A
        position behind the one recorded (a heartbeat that read it before a barrier reported a newer
        one, and arrived after it) changes nothing."""
        if position is None:
            return {}
        try:
            self.dispatcher.report(worker, *position)
        except FailedPreconditionError as exc:
            log.warning("coordinator: worker %d: %s", worker, exc)
            return {"split_lost": True}
        except InvalidArgumentError:
            if not self._behind(worker, position):
                raise
        return {}

    def release(self, worker: int) -> None:
        """`worker` left or died: its split goes back at its last reported position."""
        if not self.dispatcher.described:
            return
        for taken in self.dispatcher.release(worker):
            log.info(
                "coordinator: split %d of epoch %d goes back at batch %d (worker %d left)",
                taken.split,
                taken.epoch,
                taken.position,
                worker,
            )
        with self._cond:
            self._cond.notify_all()

    def _behind(self, worker: int, position: Position) -> bool:
        """Whether `position` is a valid position of the split `worker` holds, behind the one recorded."""
        held = self.dispatcher.holding(worker)
        epoch, split, batches = position
        return (
            held is not None
            and (held.epoch, held.split) == (epoch, split)
            and type(batches) is int
            and 0 <= batches < held.position
        )

    def _complete(self, worker: int, done: Position) -> None:
        """`worker` finished split `done`. One taken back meanwhile (it was found dead while only slow)
        goes out again from its last reported position: the worker asks for its next split as usual."""
        try:
            self.dispatcher.complete(worker, *done)
        except FailedPreconditionError as exc:
            if self.dispatcher.holding(worker) is not None:  # it holds another split: the call is wrong
                raise
            log.warning("coordinator: worker %d finished a split taken back meanwhile: %s", worker, exc)
