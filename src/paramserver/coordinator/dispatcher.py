"""The data dispatcher: which worker trains which split of the data, and how far it got.

The training script describes its data once as `num_splits` splits trained for `epochs` epochs
(`describe`). A worker asks for a split (`acquire`), trains its batches, reports its position (the
batches of that split it trained) as it goes (`report`) and when the split is done (`complete`).
A worker that leaves or dies is `release`d: its unfinished split is taken back at the last
position it reported, and the next worker to ask resumes it there.

Order: a split taken back is handed out before any new one (the oldest epoch first, then the
lowest split), whatever epoch the others are in; new splits go out in (epoch, split) order. There
is no barrier between epochs: while the last splits of epoch e are trained, idle workers start
epoch e + 1.

Guarantee: with no release, every (epoch, split) is handed out exactly once, so each batch is
trained exactly once per epoch. With releases, each batch is trained at least once, and a batch is
trained again only if the released worker trained it after its last report of that split: the
repeats are bounded by the batches it trained between its last report and its end (with reports
every heartbeat: one heartbeat interval of its batches, plus the batch in flight).

A worker holds one split at a time. `acquire` while holding one returns that one again, at its
last reported position (a retried call, or a worker restarted before it was released); a report
or completion of the split a worker completed last is accepted and changes nothing (a retried
call, or a heartbeat that raced the completion). A report for a split the worker does not hold
(it was released meanwhile: declared dead while only slow) fails: the worker must then stop
training that split and ask for another, which keeps its repeats within the bound above.

`state()` is what a checkpoint records (JSON-able); `from_state` / `load_state` validate it as
untrusted input and turn splits in flight into taken-back ones at their positions, so a restored
run goes on with any worker count. This class knows nothing of transports or of workers'
liveness: the coordinator calls it. Thread-safe: one lock guards everything; no call blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from paramserver.base.errors import FailedPreconditionError, InvalidArgumentError
from paramserver.coordinator.dispatcher_state import (
    MAX_EPOCHS,
    MAX_SPLITS,
    MAX_WORKER,
    POSITION_LIMIT,
    STATE_VERSION,
    check_int,
    parse_state,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Assignment:
    """Split `split` of epoch `epoch`, to be trained from batch `position` on."""

    epoch: int
    split: int
    position: int


@dataclass
class _Held:
    epoch: int
    split: int
    position: int
    reported_at: float  # the clock's time of its acquisition or last report

    def key(self) -> tuple[int, int]:
        return self.epoch, self.split


class Dispatcher:
    """Hands out the splits of the data to workers (module docstring). Call `describe` first."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._num_splits = 0  # 0: not described yet
        self._epochs = 0
        self._next = 0  # epoch * num_splits + split of the next new split; num_splits * epochs: all handed out
        self._held: dict[int, _Held] = {}  # by worker
        self._taken_back: dict[tuple[int, int], int] = {}  # (epoch, split) -> position
        self._last_completed: dict[int, tuple[int, int]] = {}  # by worker: retried completions are accepted
        self._batches_done = 0  # the sum of completed splits' batch counts

    # ---- the script's description ------------------------------------------------------------
    def describe(self, num_splits: int, epochs: int) -> None:
        """The data is `num_splits` splits, trained `epochs` times. Every worker's script says so;
        the first call decides, later ones must say the same."""
        check_int("num_splits", num_splits, 1, MAX_SPLITS)
        check_int("epochs", epochs, 1, MAX_EPOCHS)
        with self._lock:
            if self._num_splits and (self._num_splits, self._epochs) != (num_splits, epochs):
                raise FailedPreconditionError(
                    f"the data was described as {self._num_splits} splits x {self._epochs} epochs; "
                    f"a script now describes it as {num_splits} splits x {epochs} epochs"
                )
            if not self._num_splits:
                self._num_splits, self._epochs = num_splits, epochs
                log.info("dispatcher: %d splits x %d epochs", num_splits, epochs)

    @property
    def described(self) -> bool:
        with self._lock:
            return self._num_splits > 0

    # ---- a worker's calls ----------------------------------------------------------------------
    def acquire(self, worker: int) -> Assignment | None:
        """The split `worker` trains next: the one it holds if any; else the oldest taken back;
        else the next new one. None when none can be handed out now (`finished` or `pending`)."""
        _check_worker(worker)
        with self._lock:
            self._check_described()
            held = self._held.get(worker)
            if held is not None:
                return Assignment(held.epoch, held.split, held.position)
            if self._taken_back:
                key = min(self._taken_back)
                position = self._taken_back.pop(key)
            elif self._next < self._total():
                key, position = divmod(self._next, self._num_splits), 0
                self._next += 1
            else:
                return None
            self._held[worker] = _Held(key[0], key[1], position, self._clock())
            log.debug(
                "dispatcher: worker %d trains split %d of epoch %d from batch %d", worker, key[1], key[0], position
            )
            return Assignment(key[0], key[1], position)

    def report(self, worker: int, epoch: int, split: int, position: int) -> None:
        """`worker` trained `position` batches of the split it holds. Never backwards."""
        with self._lock:
            held = self._checked_hold(worker, epoch, split, position)
            if held is not None:
                held.position, held.reported_at = position, self._clock()

    def complete(self, worker: int, epoch: int, split: int, position: int) -> None:
        """`worker` trained the split to its end: `position` is its batch count. It holds no split now."""
        with self._lock:
            held = self._checked_hold(worker, epoch, split, position)
            if held is None:
                return
            before = self._epochs_done()
            del self._held[worker]
            self._last_completed[worker] = (epoch, split)
            self._batches_done += position
            after = self._epochs_done()
        log.debug("dispatcher: worker %d completed split %d of epoch %d (%d batches)", worker, split, epoch, position)
        for done in range(before, after):
            log.info("dispatcher: epoch %d of %d done", done + 1, self._epochs)

    def release(self, worker: int) -> list[Assignment]:
        """`worker` left or died: its unfinished split goes back at its last reported position
        (returned; empty when it held none)."""
        _check_worker(worker)
        with self._lock:
            held = self._held.pop(worker, None)
            if held is None:
                return []
            self._taken_back[held.key()] = held.position
        log.info(
            "dispatcher: took back split %d of epoch %d from worker %d at batch %d",
            held.split,
            held.epoch,
            worker,
            held.position,
        )
        return [Assignment(held.epoch, held.split, held.position)]

    def holding(self, worker: int) -> Assignment | None:
        """The split `worker` holds, at its last reported position; None if none."""
        _check_worker(worker)
        with self._lock:
            held = self._held.get(worker)
            return None if held is None else Assignment(held.epoch, held.split, held.position)

    # ---- the state of the work -----------------------------------------------------------------
    @property
    def finished(self) -> bool:
        """Every split of every epoch is done. Final (until `load_state`)."""
        with self._lock:
            return self._num_splits > 0 and self._next == self._total() and not self._held and not self._taken_back

    @property
    def pending(self) -> bool:
        """Nothing to hand out now, but other workers hold the last splits: ask again later (a
        worker that is released gives its split back)."""
        with self._lock:
            return self._next == self._total() and not self._taken_back and bool(self._held) and self._num_splits > 0

    def progress(self) -> dict:
        """For status lines (JSON-able): the epoch under way (from 0; `epochs` once finished), its
        splits done, all splits done, splits in flight by worker and those taken back."""
        with self._lock:
            now = self._clock()
            epoch = self._epochs_done()
            return {
                "num_splits": self._num_splits,
                "epochs": self._epochs,
                "epoch": epoch,
                "splits_done_in_epoch": self._done_in(epoch) if epoch < self._epochs else 0,
                "splits_done": self._next - len(self._held) - len(self._taken_back),
                "splits_total": self._total(),
                "batches_done": self._batches_done,
                "in_flight": [
                    {
                        "worker": worker,
                        "epoch": held.epoch,
                        "split": held.split,
                        "position": held.position,
                        "since_report_s": round(now - held.reported_at, 3),
                    }
                    for worker, held in sorted(self._held.items())
                ],
                "taken_back": self._taken_back_list(),
            }

    # ---- checkpoints ---------------------------------------------------------------------------
    def state(self) -> dict:
        """What a checkpoint records (JSON-able). Positions are the last reported: report exact
        ones first (at the checkpoint's cut) for an exact record."""
        with self._lock:
            self._check_described()
            in_flight = [
                {"worker": w, "epoch": h.epoch, "split": h.split, "position": h.position}
                for w, h in sorted(self._held.items())
            ]
            return {
                "version": STATE_VERSION,
                "num_splits": self._num_splits,
                "epochs": self._epochs,
                "next_epoch": self._next // self._num_splits,
                "next_split": self._next % self._num_splits,
                "in_flight": in_flight,
                "taken_back": self._taken_back_list(),
                "batches_done": self._batches_done,
            }

    @classmethod
    def from_state(cls, data: Any, clock=time.monotonic) -> Dispatcher:
        """A dispatcher continuing from `state()`'s record (validated: InvalidArgumentError names the bad field)."""
        dispatcher = cls(clock)
        dispatcher.load_state(data)
        return dispatcher

    def load_state(self, data: Any) -> None:
        """Replaces this dispatcher's state by a checkpoint's (a rollback). Splits in flight there
        are taken back at their positions; no worker holds any. A bad record changes nothing."""
        parsed = parse_state(data)
        with self._lock:
            self._num_splits, self._epochs = parsed.num_splits, parsed.epochs
            self._next = parsed.next_epoch * parsed.num_splits + parsed.next_split
            self._held, self._last_completed = {}, {}
            self._taken_back = dict(parsed.taken_back)
            self._batches_done = parsed.batches_done
        log.info(
            "dispatcher: restored at epoch %d split %d, %d splits taken back",
            parsed.next_epoch,
            parsed.next_split,
            len(parsed.taken_back),
        )

    # ---- inside the lock -----------------------------------------------------------------------
    def _checked_hold(self, worker: int, epoch: int, split: int, position: int) -> _Held | None:
        """The split `worker` holds, checked against the call's; None for the one it completed last."""
        _check_worker(worker)
        check_int("epoch", epoch, 0, MAX_EPOCHS - 1)
        check_int("split", split, 0, MAX_SPLITS - 1)
        check_int("position", position, 0, POSITION_LIMIT)
        self._check_described()
        held = self._held.get(worker)
        if held is None or held.key() != (epoch, split):
            if self._last_completed.get(worker) == (epoch, split):
                return None
            holds = "no split" if held is None else f"split {held.split} of epoch {held.epoch}"
            raise FailedPreconditionError(
                f"worker {worker} does not hold split {split} of epoch {epoch} (it holds {holds}; "
                "a split is taken back when its worker is released)"
            )
        if position < held.position:
            raise InvalidArgumentError(
                f"worker {worker}: position {position} of split {split} of epoch {epoch} goes back from {held.position}"
            )
        return held

    def _taken_back_list(self) -> list[dict]:
        return [{"epoch": e, "split": s, "position": p} for (e, s), p in sorted(self._taken_back.items())]

    def _check_described(self) -> None:
        if not self._num_splits:
            raise FailedPreconditionError("the data is not described yet: the script describes its splits first")

    def _total(self) -> int:
        return self._num_splits * self._epochs

    def _epochs_done(self) -> int:
        """The lowest epoch with a split not done (`epochs` when all are)."""
        unfinished = [held.epoch for held in self._held.values()] + [epoch for epoch, _ in self._taken_back]
        if self._next < self._total():
            unfinished.append(self._next // self._num_splits)
        return min(unfinished, default=self._epochs)

    def _done_in(self, epoch: int) -> int:
        handed_out = min(max(self._next - epoch * self._num_splits, 0), self._num_splits)
        out = sum(held.epoch == epoch for held in self._held.values()) + sum(e == epoch for e, _ in self._taken_back)
        return handed_out - out


def _check_worker(worker: Any) -> None:
    check_int("worker", worker, 0, MAX_WORKER)
