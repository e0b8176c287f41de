"""How a training script describes its data once: `num_splits` splits, and each split's batches.

The coordinator's dispatcher hands out splits (by number) to the workers as they ask, and a worker
resumes a split taken back from another at a position: the batches of that split already trained.
So a split's batches must be the same sequence every time it is read for an epoch (deterministic
for a given split and epoch; shuffle with a seed made of both), or a position means nothing.

    splits = Splits(64, lambda split, epoch: read_part(split, seed=epoch))
    splits = Splits.ranges(len(table), 64, lambda start, stop, epoch: batches_of_rows(start, stop))
    splits = Splits.files(sorted(glob("day_*.tsv")), lambda path, epoch: criteo.batches(path, 512))
    for batch in splits.batches(split, epoch, position): ...

`batches(split, epoch, position)` skips the first `position` batches by reading and dropping them.
A source that can seek avoids that: give `batches_from(split, epoch, position)` (the batches from
`position` on), or describe it with `Splits.ranges(..., batch_size=B)` when each range is read in
order, B items a batch: position p then starts the range at item start + p * B.

Importable without torch; nothing here is shared between threads (a Splits is read only).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from paramserver.base.errors import InvalidArgumentError

MAX_SPLITS = 1 << 20  # the coordinator's dispatcher takes no more
_LIMIT = (1 << 63) - 1

BatchesOf = Callable[[int, int], Iterable[Any]]  # (split, epoch) -> that split's batches
BatchesFrom = Callable[[int, int, int], Iterable[Any]]  # (split, epoch, position) -> its batches from position on


class Splits:
    """The data as `num_splits` splits; `batches_of(split, epoch)` gives a split's batches in an epoch."""

    def __init__(self, num_splits: int, batches_of: BatchesOf, batches_from: BatchesFrom | None = None) -> None:
        _check_int("num_splits", num_splits, 1, MAX_SPLITS)
        if not callable(batches_of):
            raise InvalidArgumentError(f"batches_of must be a function (split, epoch), got {type(batches_of).__name__}")
        if batches_from is not None and not callable(batches_from):
            raise InvalidArgumentError(
                f"batches_from must be a function (split, epoch, position), got {type(batches_from).__name__}"
            )
        self.num_splits = num_splits
        self._batches_of = batches_of
        self._batches_from = batches_from

    @classmethod
    def ranges(
        cls,
        total_items: int,
        num_splits: int,
        batches_of_range: Callable[[int, int, int], Iterable[Any]],
        batch_size: int | None = None,
    ) -> Splits:
        """Items 0 .. total_items - 1 cut into `num_splits` ranges of near-equal size (split k:
        `range_of(total_items, num_splits, k)`); `batches_of_range(start, stop, epoch)` gives a
        range's batches. With `batch_size`, a position is skipped by starting the range later
        (it must then read its range in order, `batch_size` items a batch)."""
        _check_int("total_items", total_items, 0, _LIMIT)
        _check_int("num_splits", num_splits, 1, MAX_SPLITS)
        if batch_size is not None:
            _check_int("batch_size", batch_size, 1, _LIMIT)
        if not callable(batches_of_range):
            raise InvalidArgumentError(
                f"batches_of_range must be a function (start, stop, epoch), got {type(batches_of_range).__name__}"
            )

        def batches_of(split: int, epoch: int) -> Iterable[Any]:
            return batches_of_range(*range_of(total_items, num_splits, split), epoch)

        def batches_from(split: int, epoch: int, position: int) -> Iterable[Any]:
            start, stop = range_of(total_items, num_splits, split)
            size = batch_size or 1
            count = -(-(stop - start) // size)
            if position > count:
                raise _past_end(split, epoch, count, position)
            return batches_of_range(min(start + position * size, stop), stop, epoch)

        return cls(num_splits, batches_of, batches_from if batch_size is not None else None)

    @classmethod
    def files(
        cls,
        paths: Iterable[str | os.PathLike] | str | os.PathLike,
        batches_of_file: Callable[[Any, int], Iterable[Any]],
    ) -> Splits:
        """One split per file, in the order given: `batches_of_file(path, epoch)` gives a file's batches."""
        listed = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths) if _iterable(paths) else []
        if not listed:
            raise InvalidArgumentError(f"paths must be a non-empty list of file paths, got {_shown(paths)}")
        _check_int("the number of files", len(listed), 1, MAX_SPLITS)
        for index, path in enumerate(listed):
            if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
                raise InvalidArgumentError(f"paths[{index}] must be a file path, got {_shown(path)}")
        if not callable(batches_of_file):
            raise InvalidArgumentError(
                f"batches_of_file must be a function (path, epoch), got {type(batches_of_file).__name__}"
            )
        return cls(len(listed), lambda split, epoch: batches_of_file(listed[split], epoch))

    def __len__(self) -> int:
        return self.num_splits

    def batches(self, split: int, epoch: int, position: int = 0) -> Iterator[Any]:
        """Split `split`'s batches in epoch `epoch`, from batch `position` on. A split with fewer
        than `position` batches (its data changed) raises InvalidArgumentError (when reached, if
        its batches are read and dropped)."""
        _check_int("split", split, 0, self.num_splits - 1)
        _check_int("epoch", epoch, 0, _LIMIT)
        _check_int("position", position, 0, _LIMIT)
        if position and self._batches_from is not None:
            return iter(self._batches_from(split, epoch, position))
        return _skipped(iter(self._batches_of(split, epoch)), position, split, epoch)


def range_of(total_items: int, num_splits: int, split: int) -> tuple[int, int]:
    """(start, stop) of split `split` of `num_splits` near-equal ranges of 0 .. total_items - 1."""
    return split * total_items // num_splits, (split + 1) * total_items // num_splits


def _skipped(batches: Iterator[Any], position: int, split: int, epoch: int) -> Iterator[Any]:
    for skipped in range(position):
        if next(batches, _END) is _END:
            raise _past_end(split, epoch, skipped, position)
    yield from batches


def _past_end(split: int, epoch: int, count: int, position: int) -> InvalidArgumentError:
    return InvalidArgumentError(
        f"split {split} of epoch {epoch} has {count} batches, fewer than its position {position}: "
        "its batches must be the same each time they are read"
    )


_END = object()


def _iterable(value: Any) -> bool:
    return isinstance(value, Iterable) and not isinstance(value, (bytes, dict))


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if type(value) is not int or not low <= value <= high:
        raise InvalidArgumentError(f"{name} must be an integer between {low} and {high}, got {_shown(value)}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."
