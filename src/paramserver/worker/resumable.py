"""Data that resumes where this worker was: `ctx.resumable(loader, epochs=E)`.

A worker's data position is its own count of trained batches. A fresh worker starts at 0,
however far the cluster is; a worker restarted alone, or a cluster resumed from a checkpoint,
goes on at the position the shards counted for it (`Context.resume_step`). Wrap any loop's
iterable and the skipping is done for you:

    for x, y in ctx.resumable(loader, epochs=10):   # a DataLoader, a list, ...
        ...
    for batch in ctx.resumable(lambda epoch: criteo.batches(path, 512, ctx.worker_index, ctx.num_workers)):
        ...

`source` is an iterable that can be iterated again for each epoch (a torch DataLoader), or a
callable taking the epoch number (from 0) and returning that epoch's iterable (a generator such
as `criteo.batches`). Skipped batches are read and dropped, so a shuffling loader with a seeded
generator replays the same order. Once the last epoch is consumed, the worker finishes its data
(`Context.finish_training`): it leaves every quorum before it waits anywhere.

The batches are pipelined (`prefetch_rows`, on by default): each step brings back the embedding
rows of the batch after it, so a plain loop gets the fast path (worker/pipeline.py).

Not thread-safe: iterate from the training thread, after the first optimizer was created (its
registration brings the position back from the shards).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from paramserver.base.errors import InvalidArgumentError, NotInitializedError
from paramserver.worker import current, pipeline

log = logging.getLogger(__name__)


class ResumableBatches:
    """`source`'s batches for `epochs` epochs, from this worker's data position on."""

    def __init__(
        self,
        source: Iterable | Callable[[int], Iterable],
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        context: Any = None,
        prefetch_rows: bool = True,
    ) -> None:
        if not isinstance(epochs, int) or epochs < 1:
            raise InvalidArgumentError(f"epochs must be a positive integer, got {epochs!r}")
        if steps_per_epoch is not None and (not isinstance(steps_per_epoch, int) or steps_per_epoch < 1):
            raise InvalidArgumentError(f"steps_per_epoch must be a positive integer, got {steps_per_epoch!r}")
        if not callable(source) and epochs > 1 and isinstance(source, Iterator):
            raise InvalidArgumentError(
                "a one-pass iterator (e.g. a generator) cannot give several epochs: pass "
                "a callable `lambda epoch: make_batches()` or a re-iterable loader"
            )
        self.source = source
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch
        self.context = context
        self.prefetch_rows = prefetch_rows
        self.position = 0  # batches of this worker trained or skipped so far
        self.skipped = 0

    def __iter__(self) -> Iterator:
        for _, batches in self.by_epoch():
            yield from batches

    def by_epoch(self) -> Iterator[tuple[int, Iterator]]:
        """(epoch from 0, its batches still to train) for every epoch, fully skipped ones included
        (so that per-epoch work such as an LR scheduler's step happens as in an undisturbed run)."""
        context = self._context()
        if context.resume_step > context.data_position:
            log.info("worker %d: data resumes at batch %d", context.worker_index, context.resume_step)
        cycle = self._cycle() if self.steps_per_epoch else None
        for epoch in range(self.epochs):
            batches = itertools.islice(cycle, self.steps_per_epoch) if cycle else iter(self._epoch_source(epoch))
            yield epoch, self._pipelined(self._counted(batches, context), context)
        context.finish_training()

    def _counted(self, batches: Iterator, context) -> Iterator:
        """The batches past this worker's position. The position counts on across every
        resumable() of the process, so a loop that wraps each epoch in its own skips right too."""
        for batch in batches:
            self.position += 1
            context.data_position += 1
            if context.data_position <= context.resume_step:
                self.skipped += 1
                continue
            yield batch

    def _pipelined(self, batches: Iterator, context) -> Iterator:
        if not self.prefetch_rows:
            return batches
        return iter(pipeline.for_context(batches, context))

    def _epoch_source(self, epoch: int) -> Iterable:
        return self.source(epoch) if callable(self.source) else self.source

    def _cycle(self) -> Iterator:
        """Pass after pass over the source (a new iteration each pass, so shuffling reshuffles)."""
        for epoch in itertools.count():
            empty = True
            for batch in self._epoch_source(epoch):
                empty = False
                yield batch
            if empty:
                raise InvalidArgumentError(
                    "the loader yielded no batch; steps_per_epoch needs a loader that can be iterated again"
                )

    def _context(self):
        if self.context is None:
            self.context = current.current_context()
        if not self.context.optimizers:
            raise NotInitializedError(
                "create the paramserver optimizer before iterating resumable data: "
                "its registration brings this worker's data position"
            )
        return self.context
