"""`ServedRows`: a table's rows held inside its embedding module, for serving with no PS.

`paramserver.serving.load` gives each HashEmbedding of a model one, from an export or a
checkpoint; the module's forward then looks ids up here, in torch operations alone (a sorted id
buffer and `torch.searchsorted`), so that `torch.export` captures the table with the model.
An id the table does not hold gets a zero row: the initial row a PS would create for it is noise
that no step trained, and zeros keep the exported program free of the PS's hash.

A delta export is merged in bounded memory (`merged`): the new buffers beside the held ones, the
delta's ids, and its rows read a slice at a time, each written once into its place.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.checkpoint.export.export_file import SLICE_BYTES, Lineage, check_distinct
from paramserver.checkpoint.store import CheckpointError


class ServedRows(nn.Module):
    """Rows of one table by id: buffers `ids` (sorted, int64) and `weight` (one row per id, then
    the zero row that unknown ids get); `lineage`: the checkpoint they are."""

    ids: torch.Tensor
    weight: torch.Tensor

    def __init__(self, ids: np.ndarray, weight: np.ndarray, dtype: torch.dtype, lineage: Lineage) -> None:
        """`ids` sorted and distinct, `weight` float32 with one row per id and the zero row after."""
        super().__init__()
        self.lineage = lineage
        self.register_buffer("ids", torch.from_numpy(ids))
        self.register_buffer("weight", torch.from_numpy(weight).to(dtype))

    @classmethod
    def empty(cls, dim: int, dtype: torch.dtype, lineage: Lineage) -> ServedRows:
        """A table with no rows (every id gets the zero row)."""
        return cls(np.zeros(0, np.int64), np.zeros((1, dim), np.float32), dtype, lineage)

    @property
    def checkpoint(self) -> str:
        return self.lineage.checkpoint

    def merged(
        self,
        ids: np.ndarray,
        rows: Iterable[tuple[np.ndarray, np.ndarray]],
        deleted: Iterable[np.ndarray],
        where: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """New (`ids`, `weight`) buffers with a delta export's table applied: the `deleted` ids
        removed, then the delta's rows (`rows`: (ids, rows) slices in `ids`' order) written over
        the held ones or added. Nothing held changes (`install` puts them in place). Memory: the
        new buffers, a few arrays of ids, one slice of rows."""
        held = self.ids.cpu().numpy()
        keep = np.ones(held.shape[0], bool)
        for chunk in (*deleted, ids):
            _unmark(held, keep, chunk)
        order = np.argsort(ids, kind="stable")
        delta_sorted = ids[order]
        check_distinct(delta_sorted, where)
        kept_at = np.flatnonzero(keep)
        kept_ids = held[kept_at]
        # where each row goes: the kept rows and the delta's are both sorted, so a row's place is its
        # rank in its own list plus the number of the other list's ids below it
        kept_place = np.arange(kept_at.shape[0]) + np.searchsorted(delta_sorted, kept_ids)
        delta_place = np.empty_like(order)
        delta_place[order] = np.arange(order.shape[0]) + np.searchsorted(kept_ids, delta_sorted)
        del order, delta_sorted
        count = kept_at.shape[0] + ids.shape[0]
        new_ids = np.empty(count, np.int64)
        new_ids[kept_place] = kept_ids
        new_ids[delta_place] = ids
        del kept_ids
        weight = torch.empty((count + 1, self.weight.shape[1]), dtype=self.weight.dtype)
        weight[count] = 0
        old = self.weight
        block = max(1, SLICE_BYTES // max(1, old.element_size() * old.shape[1]))
        for lo in range(0, kept_at.shape[0], block):
            rows_at = torch.from_numpy(kept_at[lo : lo + block]).to(old.device)
            weight[torch.from_numpy(kept_place[lo : lo + block])] = old[rows_at].cpu()
        at = 0
        for chunk_ids, chunk in rows:
            size = chunk_ids.shape[0]
            if chunk.shape != (size, weight.shape[1]) or not np.array_equal(chunk_ids, ids[at : at + size]):
                raise CheckpointError(f"{where}: its rows do not follow its ids (the file changed while it was read?)")
            weight[torch.from_numpy(delta_place[at : at + size])] = torch.from_numpy(chunk).to(weight.dtype)
            at += size
        if at != ids.shape[0]:
            raise CheckpointError(f"{where}: {at} rows for {ids.shape[0]} ids")
        return torch.from_numpy(new_ids), weight

    def install(self, ids: torch.Tensor, weight: torch.Tensor, lineage: Lineage) -> None:
        """Hold `merged`'s buffers (on the device the held ones are on); they are `lineage`'s rows."""
        self.ids = ids.to(self.ids.device)
        self.weight = weight.to(self.weight.device)
        self.lineage = lineage

    def index(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row in `weight` (same shape as `ids`); the last, zero row for an unknown id."""
        count = self.ids.shape[0]
        if count == 0:
            return torch.zeros_like(ids)
        at = torch.searchsorted(self.ids, ids).clamp(max=count - 1)
        return torch.where(self.ids[at] == ids, at, count)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.index(ids), self.weight)


def _unmark(held: np.ndarray, keep: np.ndarray, ids: np.ndarray) -> None:
    """Mark the held (sorted) ids that are among `ids` as not kept."""
    if not held.shape[0] or not ids.shape[0]:
        return
    at = np.minimum(np.searchsorted(held, ids), held.shape[0] - 1)
    keep[at[held[at] == ids]] = False
