"""A streaming reader of Criteo's TSV format (the Display Advertising Challenge layout).

Each line: label (0/1), 13 integer features, 26 categorical features (hex strings in
Criteo's data; any string works), tab separated; any feature may be empty. Lines are read
lazily, a batch at a time, from one or more files (or any iterable of lines), and each batch
is parsed with vectorized numpy, so a dataset larger than memory streams through quickly.

A batch is (dense, sparse, labels): dense float32 (B, 13) = log(1 + max(x, 0)) with missing
as 0; sparse int64 (B, 26) = the feature index in the top 8 bits and a 56-bit hash of the
value's string below them, so one shared table keeps the 26 features apart (an empty value
is a value of its own); labels float32 (B,).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from ..errors import InvalidArgumentError
from ..server import kernels
from ..server.hash_index import mix64
from .loader import BatchLoader

NUM_DENSE, NUM_SPARSE = 13, 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE
_LOW56 = np.uint64((1 << 56) - 1)
_FEATURE = (np.arange(NUM_SPARSE, dtype=np.uint64) << np.uint64(56))


class CriteoFormatError(ValueError):
    """A line that is not in Criteo's format; names the line."""


def parse_lines(lines: list[str], numbers: int | list[int] = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense, sparse, labels) arrays of a list of lines; a bad line raises CriteoFormatError
    naming its number (`numbers`: each line's, or the first's)."""
    try:
        return _parse(lines)
    except (ValueError, CriteoFormatError):
        numbers = range(numbers, numbers + len(lines)) if isinstance(numbers, int) else numbers
        for number, line in zip(numbers, lines):  # find the culprit for the message
            try:
                _parse([line])
            except (ValueError, CriteoFormatError) as exc:
                raise CriteoFormatError(f"line {number}: {exc}") from None
        raise


def _parse(lines: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    parsed = _parse_plain(lines) if kernels.KERNELS is not None else None
    return parsed if parsed is not None else _parse_numpy(lines)


def _parse_plain(lines: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The C parser, for the plain subset of the format (the same results); None outside it."""
    text = "".join(lines)
    if not text.endswith("\n"):
        text += "\n"
    try:
        data = text.encode("ascii")
    except UnicodeEncodeError:
        return None
    n = len(lines)
    labels, dense = np.empty(n, np.float32), np.empty((n, NUM_DENSE), np.float32)
    sparse = np.empty((n, NUM_SPARSE), np.int64)
    done = kernels.KERNELS.ps_parse_criteo(data, len(data), n, kernels.ptr(labels), kernels.ptr(dense),
                                           kernels.ptr(sparse))
    return (dense, sparse, labels) if done == n else None


def _parse_numpy(lines: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    fields = "\t".join(line.rstrip("\n") for line in lines).split("\t")
    if len(fields) != len(lines) * NUM_FIELDS:
        raise CriteoFormatError(f"{len(fields)} fields, expected {NUM_FIELDS} per line")
    table = np.array(fields, dtype=object).reshape(len(lines), NUM_FIELDS)
    labels = table[:, 0].astype(np.float32)
    dense = np.array(table[:, 1:1 + NUM_DENSE].ravel(), dtype="S20")
    dense[dense == b""] = b"0"
    dense = np.log1p(np.maximum(dense.astype(np.int64), 0)).astype(np.float32).reshape(len(lines), NUM_DENSE)
    packed = np.array(table[:, 1 + NUM_DENSE:].ravel(), dtype="S16").view(np.uint64).reshape(-1, 2)
    hashed = mix64((packed[:, 0] ^ mix64(packed[:, 1].view(np.int64))).view(np.int64))
    sparse = (hashed.reshape(len(lines), NUM_SPARSE) & _LOW56) | _FEATURE
    return dense, sparse.view(np.int64), labels


def _lines(source) -> Iterator[str]:
    if isinstance(source, (str, Path)):
        source = [source]
    for item in source:
        if isinstance(item, Path) or (isinstance(item, str) and "\t" not in item):
            with open(item) as handle:
                yield from handle
        else:
            yield item


def batches(source, batch_size: int, skip: int = 0, every: int = 1, prefetch: int = 0) -> Iterator[tuple]:
    """Batches of (dense, sparse, labels) torch tensors from files or lines; `skip`/`every` keep every
    `every`-th line starting at `skip` (a worker's shard: skip=worker_index, every=num_workers).

    prefetch > 0 parses in a loader process that keeps up to that many batches ready
    (paramserver.data.loader); `source` must then be file paths.
    """
    if prefetch:
        paths = [str(p) for p in ([source] if isinstance(source, (str, Path)) else source)]
        arrays = BatchLoader(array_batches, paths, batch_size, skip, every, depth=prefetch)
    else:
        arrays = array_batches(source, batch_size, skip, every)
    for batch in arrays:
        yield _tensors(batch)


def array_batches(source, batch_size: int, skip: int = 0, every: int = 1) -> Iterator[tuple[np.ndarray, ...]]:
    """As `batches`, as numpy arrays, in this process."""
    if not (isinstance(every, int) and every >= 1 and isinstance(skip, int) and 0 <= skip < every):
        raise InvalidArgumentError(f"line sharding needs 0 <= skip < every, got skip={skip!r}, every={every!r}")
    chunk, numbers = [], []
    # the striding runs in C (islice), numbering each kept line by its line in the source
    kept = zip(itertools.count(skip + 1, every), itertools.islice(_lines(source), skip, None, every))
    for number, line in kept:
        if not line.strip():
            continue
        chunk.append(line)
        numbers.append(number)
        if len(chunk) == batch_size:
            yield parse_lines(chunk, numbers)
            chunk, numbers = [], []
    if chunk:
        yield parse_lines(chunk, numbers)


def _tensors(arrays) -> tuple:
    import torch  # here, so that a loader process parses without importing torch

    dense, sparse, labels = arrays
    return torch.from_numpy(dense), torch.from_numpy(np.ascontiguousarray(sparse)), torch.from_numpy(labels)
