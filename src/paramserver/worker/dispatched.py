"""Data the coordinator hands out: `ctx.resumable(paramserver.Splits(...), epochs=E)`.

The script describes its data once as splits (data/splits.py: `num_splits`, and a split's batches for
an epoch from a position); every worker asks the coordinator for its next split, trains it, and asks
again (coordinator/dispatcher.py). The worker's position in its split (the batches of it trained) is
kept in the coordinator client, which sends it with each heartbeat, at each barrier and when it
leaves: a worker that leaves or dies has its split taken back at that position, and a checkpoint
records the positions of all, exact at its cut. So each batch is trained once per epoch whatever
the worker count does (at least once when a worker dies: docs/elastic.md).

A batch counts as trained once its step was taken (the optimizer's step hook, `stepped`) or the
next batch is asked for. A worker that finds no split while others hold the last ones steps out of
every quorum and waits (polls of a few seconds; a checkpoint does not wait for it); a split taken
back brings it in again. Each split is pipelined on its own: the row prefetch does not read into
the next split, so a split is complete only once its last batch was trained.

Not thread-safe: iterate from the training thread, after the first optimizer was created.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Generator, Iterator
from typing import Any

from paramserver.base.errors import InvalidArgumentError
from paramserver.worker import pipeline

log = logging.getLogger(__name__)
_WAIT_S = 5.0  # one Split poll while others hold the last splits
Position = tuple[int, int, int]  # (epoch, split, batches of it trained)


class Interleaved:
    """A loader given to an elastic run as it is: split k of n keeps its batches k, k + n, k + 2n, ...
    Each split reads the whole loader (and drops the rest): give `paramserver.Splits` for data that
    can be read in parts. `source`: a re-iterable loader, or a callable taking the epoch."""

    def __init__(self, source: Any, num_splits: int) -> None:
        if isinstance(source, Iterator) and not callable(source):
            raise InvalidArgumentError(
                "an elastic run hands out a loader's batches by index, reading it once per split: pass a "
                "re-iterable loader, a callable `lambda epoch: batches`, or paramserver.Splits, not a one-pass iterator"
            )
        self.source = source
        self.num_splits = num_splits

    def batches(self, split: int, epoch: int, position: int = 0) -> Iterator[Any]:
        loader = self.source(epoch) if callable(self.source) else self.source
        kept = itertools.islice(loader, split, None, self.num_splits)
        return itertools.islice(kept, position, None)


def is_splits(source: Any) -> bool:
    """Whether `source` describes split data (paramserver.Splits, or anything with its two methods)."""
    return hasattr(source, "num_splits") and callable(getattr(source, "batches", None))


class DispatchedBatches:
    """`splits`' batches for `epochs` epochs, as the coordinator hands them to this worker."""

    def __init__(self, splits: Any, epochs: int, context: Any, prefetch_rows: bool = True) -> None:
        if context.options.dense_sync == "allreduce":
            raise InvalidArgumentError("data handed out by the coordinator (Splits) needs dense_sync 'ps'")
        self.splits = splits
        self.epochs = epochs
        self.context = context
        self.prefetch_rows = prefetch_rows
        self.splits_trained = 0  # splits this worker finished
        self.skipped = 0  # batches read and dropped (Trainer.fit reads it): none, a split resumes at its position
        self._next: Position | None = None  # the split to train next, once the coordinator gave it
        self._yielded = 0  # batches of the current split handed to the loop

    def __iter__(self) -> Iterator:
        for _, batches in self.by_epoch():
            yield from batches

    def by_epoch(self) -> Iterator[tuple[int, Iterator]]:
        """(epoch, its batches) for each run of splits of one epoch this worker is given, in the order
        given (a split taken back from an earlier epoch may come after a later epoch's)."""
        self.context.dispatched = self
        try:
            self._next = self._ask(None)
            while self._next is not None:
                epoch = self._next[0]
                yield epoch, self._epoch(epoch)
        finally:  # the position stays: a worker that leaves hands its split back at it
            self.context.dispatched = None
        log.info("worker %d: the data is done; it trained %d splits", self._worker, self.splits_trained)
        self.context.finish_training()

    def stepped(self) -> None:
        """The loop took a step on the batch it was handed last: that batch is trained."""
        coordinator = self.context.coordinator
        if coordinator.position is not None:
            epoch, split, _ = coordinator.position
            coordinator.position = (epoch, split, self._yielded)

    def _epoch(self, epoch: int) -> Iterator:
        while self._next is not None and self._next[0] == epoch:
            trained = yield from self._split(*self._next)
            self._next = self._ask(trained)

    def _split(self, epoch: int, split: int, start: int) -> Generator[Any, None, Position | None]:
        """The split's batches from `start`; returns its position once done (None: it was taken back)."""
        coordinator = self.context.coordinator
        self._yielded = start
        coordinator.position = (epoch, split, start)
        batches = self.splits.batches(split, epoch, start)
        for batch in pipeline.for_context(batches, self.context) if self.prefetch_rows else batches:
            coordinator.position = (epoch, split, self._yielded)  # the batch before this one is trained
            if coordinator.split_lost:
                coordinator.split_lost = False
                log.warning("worker %d: split %d of epoch %d was taken back: leaving it", self._worker, split, epoch)
                return None
            self._yielded += 1
            yield batch
        self.splits_trained += 1
        return (epoch, split, self._yielded)

    def _ask(self, done: Position | None) -> Position | None:
        """The next split from the coordinator, after `done`; waiting (out of every quorum) while others
        hold the last ones. None once the data is done."""
        coordinator, context = self.context.coordinator, self.context
        coordinator.position = None
        view = coordinator.split(self.splits.num_splits, self.epochs, done, 0.0)
        idle = False
        while view.get("split") is None and not view.get("data_done"):
            if not idle:
                idle = True
                context.idle()
                log.info("worker %d: the last splits are held by others: waiting for one taken back", self._worker)
            view = coordinator.split(self.splits.num_splits, self.epochs, None, _WAIT_S)
        if view.get("split") is None:
            return None
        if idle:
            context.busy()
        epoch, split, position = view["split"]
        return epoch, split, position

    @property
    def _worker(self) -> int:
        return self.context.worker_index
