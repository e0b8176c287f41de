"""Criteo files read by split: split k of n owns the lines that start in its byte range of the files,
so that a split reads only its part (the coordinator's dispatcher hands splits out: docs/elastic.md).
Batches, parsing and errors are those of data/criteo.py."""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from paramserver.base.errors import InvalidArgumentError
from paramserver.data.background import BackgroundBatches
from paramserver.data.criteo import (
    _BLOCK_BYTES,
    PARSE_AHEAD,
    _BadLine,
    _batched,
    _format_error,
    _is_path,
    _locate,
    _parse,
    _tensors,
    _without_blanks,
)


def split_batches(
    paths, batch_size: int, split: int, num_splits: int, parse_ahead: int = PARSE_AHEAD, position: int = 0
) -> Iterator[tuple]:
    """Batches of (dense, sparse, labels) torch tensors of split `split` of `num_splits` of Criteo
    files, as `batches` gives them. With S the files' total size in bytes (taken once, here), split
    k owns the lines that start in bytes [k*S//n, (k+1)*S//n) of the files read one after another:
    every line belongs to exactly one split, and a split reads its own bytes only (plus the rest of
    its last line, and the end of the line before its first). Blank lines are skipped; a bad line's
    error names its file and line number (counted only then). `position` > 0 starts after that
    many batches, skipping their lines unparsed (past the split's end: InvalidArgumentError when
    reached). For a dispatcher's splits (data/splits.py), resumed without parsing what is skipped:
    `Splits(n, lambda k, e: split_batches(paths, B, k, n), lambda k, e, p: split_batches(paths, B, k, n, position=p))`.
    Arguments are checked here."""
    listed = _split_paths(paths)
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise InvalidArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not (isinstance(num_splits, int) and num_splits >= 1 and isinstance(split, int) and 0 <= split < num_splits):
        raise InvalidArgumentError(
            f"splits need 0 <= split < num_splits, got split={split!r}, num_splits={num_splits!r}"
        )
    if not (isinstance(position, int) and position >= 0):
        raise InvalidArgumentError(f"position must be a non-negative integer, got {position!r}")
    sizes = [os.path.getsize(path) for path in listed]
    arrays = lambda: _byte_range_batches(listed, sizes, batch_size, split, num_splits, position)
    if parse_ahead:
        return iter(BackgroundBatches(lambda: map(_tensors, arrays()), parse_ahead, name="parse-criteo"))
    return map(_tensors, arrays())


def _split_paths(paths) -> list[str]:
    listed = [paths] if isinstance(paths, (str, Path)) else list(paths) if isinstance(paths, Iterable) else []
    if not listed or not all(isinstance(path, (str, Path)) and _is_path(path) for path in listed):
        raise InvalidArgumentError(f"split_batches reads files: give a non-empty list of paths, got {paths!r:.80}")
    return [str(path) for path in listed]


def _byte_range_batches(
    paths: list[str], sizes: list[int], batch_size: int, split: int, num_splits: int, position: int
) -> Iterator[tuple[np.ndarray, ...]]:
    total = sum(sizes)
    start, stop = split * total // num_splits, (split + 1) * total // num_splits
    kept = _range_lines(paths, sizes, start, stop)
    if position:
        kept = _skipped_lines(kept, position, batch_size, f"split {split} of {num_splits}")
    for lines, segments in _batched(kept, batch_size):
        try:
            yield _parse(lines)
        except _BadLine as bad:  # segments hold byte offsets: count the lines before this one now
            path, offset = _locate(segments, bad.index)
            raise _format_error(bad, path, _line_number(path, offset)) from None


def _skipped_lines(
    blocks: Iterator[tuple[str | None, Sequence[int], list[bytes]]], position: int, batch_size: int, name: str
) -> Iterator[tuple[str | None, Sequence[int], list[bytes]]]:
    """`blocks` after their first `position` batches' lines; refused if there are not `position` batches."""
    skip = position * batch_size
    for path, numbers, lines in blocks:
        if skip < len(lines):
            yield path, numbers[skip:], lines[skip:]
            skip = 0
        else:
            skip -= len(lines)
    if skip >= batch_size:  # fewer than `position` batches (the last one may be short)
        batches = position - skip // batch_size  # ceil((position * batch_size - skip) / batch_size)
        raise InvalidArgumentError(f"{name} has {batches} batches, fewer than its position {position}")


def _range_lines(
    paths: list[str], sizes: list[int], start: int, stop: int
) -> Iterator[tuple[str | None, Sequence[int], list[bytes]]]:
    """(file, byte offsets, lines) of the lines that start in bytes [start, stop) of the files read
    one after another, in blocks, without blank lines."""
    base = 0
    for path, size in zip(paths, sizes):
        low, high = max(start - base, 0), min(stop - base, size)
        base += size
        if low < high:
            yield from _file_range(path, low, high)


def _file_range(path: str, low: int, high: int) -> Iterator[tuple[str, Sequence[int], list[bytes]]]:
    """Lines of one file that start in bytes [low, high): a file's start is a line's start; else a
    line starts after a "\\n", so the line holding byte low - 1 belongs to the split before."""
    with open(path, "rb") as handle:
        at = low
        if low:
            handle.seek(low - 1)
            at = low - 1 + len(handle.readline())
        while at < high and (lines := handle.readlines(_BLOCK_BYTES)):
            offsets = list(itertools.accumulate(map(len, lines), initial=at))
            kept = bisect.bisect_left(offsets, high, hi=len(lines))  # lines that start before `high`
            lines, numbers, at = lines[:kept], offsets[:kept], offsets[-1]
            if not lines[-1].endswith(b"\n"):  # the file's last line
                lines[-1] += b"\n"
            if not all(lines) or any(map(bytes.isspace, lines)):
                lines, numbers = _without_blanks(lines, numbers)
            if lines:
                yield path, numbers, lines


def _line_number(path: str | None, offset: int | None) -> int | None:
    """The number (from 1) of the line at byte `offset` of file `path`: 1 + the "\\n"s before it."""
    if path is None or offset is None:
        return None
    newlines = 0
    with open(path, "rb") as handle:
        while offset > 0 and (block := handle.read(min(offset, _BLOCK_BYTES))):
            newlines += block.count(b"\n")
            offset -= len(block)
    return newlines + 1
