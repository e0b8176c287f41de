"""Which new ids of a table get a row: RowPolicy's admit_after and admit_probability.

One rule for EmbeddingTable and TieredTable: the same counts and random draws (one generator seeded
0, one draw per candidate in the order given), so that a tiered table admits exactly the ids an
in-memory one does when offered the same candidates in the same order. Ids looked up but not admitted yet
are counted in memory, as EmbeddingTable counts them. Not thread-safe: the owning table serializes calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from paramserver.tables.hash_index import HashIndex

if TYPE_CHECKING:  # embedding_table imports this module
    from paramserver.tables.embedding_table import RowPolicy


class Admission:
    def __init__(self, policy: RowPolicy) -> None:
        self.policy = policy
        self.candidates = HashIndex(64)  # ids looked up but not admitted yet, with their counts
        self.counts = np.zeros(64, np.int64)
        self._rng = np.random.default_rng(0)

    def admit(self, ids: np.ndarray) -> np.ndarray:
        """Which of these new ids (distinct, without a row) get a row now (bool per id)."""
        policy = self.policy
        admit = np.ones(ids.shape[0], bool)
        if policy.admit_after > 1:
            slots = self.candidates.find(ids)
            fresh = slots < 0
            if fresh.any():
                slots[fresh] = self.candidates.insert(ids[fresh])
                if self.candidates.size > self.counts.shape[0]:
                    grown = np.zeros(2 * self.candidates.size, np.int64)
                    grown[: self.counts.shape[0]] = self.counts
                    self.counts = grown
            self.counts[slots] += 1
            admit &= self.counts[slots] >= policy.admit_after
        if policy.admit_probability < 1:
            admit |= self._rng.random(ids.shape[0]) < policy.admit_probability
        return admit
