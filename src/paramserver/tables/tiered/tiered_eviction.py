"""RowPolicy's eviction rules (ttl_steps, min_count, max_rows) over rows that are read in chunks.

An EmbeddingTable decides over arrays of all its rows at once; a tiered table's rows are mostly on
disk, so the same decision is made over a scan of them, in bounded memory, and gives the same rows:
- ttl_steps and min_count decide each row alone (one pass);
- max_rows keeps the rows EmbeddingTable's stable sort keeps: ranked by last_seen (zero for a row
  the other rules drop), most recent first, ties in admission order ("born"). A first pass counts
  the rows of each rank key; the key where the count reaches max_rows is the cutoff; a second
  collects the admission numbers of the rows at the cutoff, of which the oldest fill the quota.
  Memory: one count per distinct last_seen value (at most the table's update count), and the rows
  at the cutoff.
Each chunk is a mapping of "last_seen", "seen" and "born" arrays (a dict, or structured records).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from paramserver.tables.embedding_table import RowPolicy

Chunk = Mapping[str, np.ndarray] | np.ndarray  # a dict of arrays, or structured records
KeepRule = Callable[[Chunk], np.ndarray]


def keep_rule(policy: RowPolicy, steps: int, scan: Callable[[], Iterable[Chunk]]) -> KeepRule:
    """What decides, chunk by chunk, which rows stay (a bool per row). `scan()` yields every row
    once, the same rows each time it is called; max_rows reads them once or twice here."""

    def by_rules(chunk: Chunk) -> np.ndarray:
        keep = np.ones(chunk["last_seen"].shape[0], bool)
        if policy.ttl_steps:
            keep &= steps - chunk["last_seen"] <= policy.ttl_steps
        if policy.min_count:
            keep &= chunk["seen"] >= policy.min_count
        return keep

    if not policy.max_rows:
        return by_rules
    counts, kept = _KeyCounts(), 0
    for chunk in scan():
        keep = by_rules(chunk)
        kept += int(keep.sum())
        counts.add(chunk["last_seen"] * keep)
    if kept <= policy.max_rows:
        return by_rules
    cutoff, quota = counts.cutoff(policy.max_rows)
    at_cutoff = [chunk["born"][chunk["last_seen"] * by_rules(chunk) == cutoff] for chunk in scan()]
    last_born = np.partition(np.concatenate(at_cutoff), quota - 1)[quota - 1]

    def by_rank(chunk: Chunk) -> np.ndarray:
        key = chunk["last_seen"] * by_rules(chunk)
        return (key > cutoff) | ((key == cutoff) & (chunk["born"] <= last_born))

    return by_rank


class _KeyCounts:
    """How many rows have each rank key, over the chunks added."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, np.int64)
        self.counts = np.zeros(0, np.int64)

    def add(self, keys: np.ndarray) -> None:
        new_keys, new_counts = np.unique(keys, return_counts=True)
        self.keys, where = np.unique(np.concatenate([self.keys, new_keys]), return_inverse=True)
        counts = np.zeros(self.keys.shape[0], np.int64)
        np.add.at(counts, where.reshape(-1), np.concatenate([self.counts, new_counts]))
        self.counts = counts

    def cutoff(self, quota: int) -> tuple[int, int]:
        """(key, n): rows with a higher key number fewer than `quota`; with n of the rows at `key`
        they make `quota`."""
        keys, counts = self.keys[::-1], np.cumsum(self.counts[::-1])  # highest key first
        at = int(np.searchsorted(counts, quota))
        above = int(counts[at - 1]) if at else 0
        return int(keys[at]), quota - above
