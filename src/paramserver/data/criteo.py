"""A streaming reader of Criteo's TSV format (the Display Advertising Challenge layout).

Each line: label (0/1), 13 integer features, 26 categorical features as hex strings, tab
separated; any feature may be empty. Lines are read lazily, a batch at a time, from one or
more files (or any iterable of lines), so a dataset larger than memory streams through.

A batch is (dense, sparse, labels): dense float32 (B, 13) = log(1 + max(x, 0)) with missing
as 0; sparse int64 (B, 26) = feature index in the top 8 bits and the hex value below them,
so one shared table keeps the 26 features apart (an empty value gets its own id per feature);
labels float32 (B,).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

NUM_DENSE, NUM_SPARSE = 13, 26
_MISSING = (1 << 56) - 1  # the id an empty categorical value gets, within its feature


class CriteoFormatError(ValueError):
    """A line that is not in Criteo's format; names the line."""


def parse_line(line: str, number: int = 0) -> tuple[list[float], list[int], float]:
    fields = line.rstrip("\n").split("\t")
    if len(fields) != 1 + NUM_DENSE + NUM_SPARSE:
        raise CriteoFormatError(f"line {number}: {len(fields)} fields, expected {1 + NUM_DENSE + NUM_SPARSE}")
    try:
        label = float(fields[0])
        dense = [math.log1p(max(int(v), 0)) if v else 0.0 for v in fields[1:1 + NUM_DENSE]]
        sparse = [(f << 56) | (int(v, 16) & _MISSING if v else _MISSING)
                  for f, v in enumerate(fields[1 + NUM_DENSE:])]
    except ValueError as exc:
        raise CriteoFormatError(f"line {number}: {exc}") from None
    return dense, sparse, label


def _lines(source: str | Path | Iterable[str] | list) -> Iterator[str]:
    if isinstance(source, (str, Path)):
        source = [source]
    for item in source:
        if isinstance(item, (str, Path)) and "\t" not in str(item):
            with open(item) as handle:
                yield from handle
        else:
            yield item


def batches(source, batch_size: int, skip: int = 0, every: int = 1) -> Iterator[tuple[torch.Tensor, ...]]:
    """Batches of (dense, sparse, labels) from files or lines; `skip`/`every` take every `every`-th
    line starting at `skip` (a worker's shard: skip=worker_index, every=num_workers)."""
    dense, sparse, labels = [], [], []
    for number, line in enumerate(_lines(source)):
        if number % every != skip or not line.strip():
            continue
        d, s, y = parse_line(line, number + 1)
        dense.append(d)
        sparse.append(s)
        labels.append(y)
        if len(labels) == batch_size:
            yield _tensors(dense, sparse, labels)
            dense, sparse, labels = [], [], []
    if labels:
        yield _tensors(dense, sparse, labels)


def _tensors(dense, sparse, labels) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.tensor(dense, dtype=torch.float32), torch.from_numpy(np.array(sparse, dtype=np.uint64).view(np.int64)),
            torch.tensor(labels, dtype=torch.float32))
