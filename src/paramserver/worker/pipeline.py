"""Embedding rows fetched one step ahead, for a plain training loop: `RowPipeline`.

A step's PushPull can bring back the rows of a later batch (`HashEmbedding.prefetch`), so that
batch's forward needs no request of its own. The pipeline does this for a loop written plainly:

    for dense, sparse, labels in ctx.resumable(loader):      # pipelined by default
        loss = loss_fn(model(dense, sparse), labels)
        loss.backward(); opt.step()
    for batch in paramserver.pipeline(loader):                # the same, without resumption
        ...

It reads the loader ahead (one batch, two when the table's optimizer overlaps; the next one is read
while a step waits for its reply) and, after a table's forward on the current batch, asks for the
same table's rows of the batch the next reply serves.
Which element of a batch feeds which table is learned at the first forward: the ids a module is
given must be an element of the batch (a tensor of a tuple, list or dict, as TorchRec's pipeline
needs a model input); a module given something else (a slice, a computed tensor) looks its rows up
at the forward as without the pipeline, and says so once in the log. The rows are exactly those
an unpipelined loop reads, in both modes: an exact-mode step's reply is read after its update, an
overlapped one's a step later (docs/embeddings.md).

Not thread-safe: iterate from the training thread, after the optimizers are created.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch

log = logging.getLogger(__name__)

_UNKNOWN, _NOT_IN_BATCH = object(), object()


def _find(batch: Any, ids: Any, depth: int = 2) -> tuple | object:
    """The path (indices / keys) of `ids` inside `batch`, by identity; _NOT_IN_BATCH if absent."""
    if batch is ids:
        return ()
    if depth == 0:
        return _NOT_IN_BATCH
    items = batch.items() if isinstance(batch, dict) else enumerate(batch) if isinstance(batch, (tuple, list)) else ()
    for key, value in items:
        path = _find(value, ids, depth - 1)
        if path is not _NOT_IN_BATCH:
            return (key, *cast(tuple, path))  # anything but the sentinel is a path
    return _NOT_IN_BATCH


def _at(batch: Any, path: tuple) -> Any:
    for key in path:
        try:
            batch = batch[key]
        except (KeyError, IndexError, TypeError):
            return _NOT_IN_BATCH  # a batch shaped unlike the first
    return batch


class RowPipeline:
    """`batches`, each yielded while the embedding rows of a later one ride along the steps.

    `modules`: [(HashEmbedding, ahead)], ahead = how many batches later the rows asked for after
    a forward are read (1; 2 when its optimizer overlaps). `optimizers`: those whose `step` may read
    the next batch while it waits for the PS (each one's `while_waiting`, set while iterating).
    """

    def __init__(self, batches: Iterable, modules: list[tuple[Any, int]], optimizers: Iterable = ()) -> None:
        self.batches = batches
        self.optimizers = [opt for opt in optimizers if not opt.overlap]  # those whose step waits for its reply
        self.ahead = {module: ahead for module, ahead in modules}
        self.paths: dict[Any, Any] = {module: _UNKNOWN for module in self.ahead}
        self.window: deque = deque()  # the current batch first, then those read ahead
        self.asked: set = set()  # modules whose later rows were asked for during the current batch
        self.prefetched = 0  # prefetches asked for, over the whole iteration
        self.exhausted = False
        self.failed: Exception | None = None  # the loader's error, raised while a step waited

    def __iter__(self) -> Iterator:
        if not self.ahead and not self.optimizers:
            yield from self.batches
            return
        source = iter(self.batches)
        depth = max(self.ahead.values(), default=0) + 1
        hooks = [module.register_forward_hook(self._after_forward) for module in self.ahead]
        for optimizer in self.optimizers:  # the next batch is read while a step waits for the PS
            optimizer.while_waiting = lambda: self._read_while_waiting(source, depth + 1)
        try:
            self._fill(source, depth)
            while self.window:
                self.asked.clear()
                yield self.window[0]
                self.window.popleft()
                self._fill(source, depth)
        finally:
            for hook in hooks:
                hook.remove()
            for optimizer in self.optimizers:
                optimizer.while_waiting = None
            self.window.clear()

    def _fill(self, source: Iterator, depth: int) -> None:
        """Read batches until the window holds `depth` (fewer at the end of the data). A loader
        error raised while a step waited is raised here, in the loop."""
        if self.failed is not None:
            failed, self.failed = self.failed, None
            raise failed
        while len(self.window) < depth and not self.exhausted:
            try:
                self.window.append(next(source))
            except StopIteration:
                self.exhausted = True

    def _read_while_waiting(self, source: Iterator, depth: int) -> None:
        """An optimizer's `while_waiting`: one more batch read, its error kept for the loop."""
        if self.failed is None:
            try:
                self._fill(source, depth)
            except Exception as exc:
                self.failed = exc

    def _after_forward(self, module, args: tuple, output) -> None:
        """A table's forward hook: ask for its rows of the batch its next reply serves."""
        if not (self.window and args and module.training and torch.is_grad_enabled()) or module in self.asked:
            return
        path = self.paths[module]
        if path is _UNKNOWN:
            path = self.paths[module] = _find(self.window[0], args[0])
            if path is _NOT_IN_BATCH:
                log.info(
                    "table %s: its ids are not an element of the batch; its rows are looked up at the "
                    "forward (no prefetch)",
                    module.table_name,
                )
        if path is _NOT_IN_BATCH or _at(self.window[0], path) is not args[0]:
            return  # another forward (evaluation inside the loop, a second use of the table)
        ahead = self.ahead[module]
        self.asked.add(module)
        later = _at(self.window[ahead], path) if len(self.window) > ahead else _NOT_IN_BATCH
        if later is not _NOT_IN_BATCH:
            module.prefetch(later)
            self.prefetched += 1


def for_context(batches: Iterable, context) -> RowPipeline:
    """`batches` pipelined for the tables and optimizers of `context`."""
    ahead: dict[Any, int] = {}
    for optimizer in context.optimizers:
        for module in getattr(optimizer, "_embeddings", ()):
            unit = module.prefetch_unit() if module.prefetch_unit is not None else None
            if unit is None or not any(m is module for m in unit.modules()):  # gone, or a copy's tables
                unit = module  # a collection's tables are prefetched by the collection, others on their own
            ahead[unit] = max(ahead.get(unit, 0), 2 if optimizer.overlap else 1)
    return RowPipeline(batches, list(ahead.items()), context.optimizers)
