"""Hashing shared by the worker, the shards and the data readers.

`mix64` spreads ids (the murmur3 finalizer); an id lives on shard `shard_of(id)`; the worker's
distinct ids start from `empty_slots` (the shard's table index, server/hash_index.py, marks an
empty slot with 0 instead, so that a zeroed array is empty without a fill pass).
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def mix64(ids: np.ndarray) -> np.ndarray:
    """A well-spread 64-bit hash of each id (the murmur3 finalizer)."""
    x = ids.astype(np.int64, copy=False).view(np.uint64)
    x = x ^ (x >> _S33)
    x = x * _M1
    x = x ^ (x >> _S33)
    x = x * _M2
    return x ^ (x >> _S33)


def empty_slots(capacity: int) -> np.ndarray:
    """(capacity x 2) int64 slots of (key, row); row -1 marks an empty slot (ps_unique's scratch)."""
    slots = np.empty((capacity, 2), np.int64)
    slots[:, 0] = 0
    slots[:, 1] = -1
    return slots


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard that holds each id of a table: every shard holds a part of every table."""
    return (mix64(ids) % np.uint64(num_shards)).astype(np.int64)
