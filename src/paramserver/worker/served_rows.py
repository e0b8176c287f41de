"""`ServedRows`: a table's rows held inside its embedding module, for serving with no PS.

`paramserver.serving.load` gives each HashEmbedding of a model one, from an export or a
checkpoint; the module's forward then looks ids up here, in torch operations alone (a sorted id
buffer and `torch.searchsorted`), so that `torch.export` captures the table with the model.
An id the table does not hold gets a zero row: the initial row a PS would create for it is noise
that no step trained, and zeros keep the exported program free of the PS's hash.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ServedRows(nn.Module):
    """Rows of one table by id: buffers `ids` (sorted, int64) and `weight` (one row per id, then
    the zero row that unknown ids get)."""

    ids: torch.Tensor
    weight: torch.Tensor

    def __init__(self, ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, checkpoint: str = "") -> None:
        super().__init__()
        self.checkpoint = checkpoint  # the checkpoint these rows are (a delta export names the one it applies to)
        order = torch.argsort(ids)
        zero = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        self.register_buffer("ids", ids[order].contiguous())
        self.register_buffer("weight", torch.cat([weight[order], zero]).to(dtype))

    def update_rows(self, ids: torch.Tensor, weight: torch.Tensor, deleted: torch.Tensor, checkpoint: str) -> None:
        """Update the rows in place with a delta export's table (checkpoint/delta_export.py): the
        `deleted` ids removed, then the rows of `ids` written over the held ones or added; they are
        then `checkpoint`'s."""
        keep = ~(torch.isin(self.ids, deleted) | torch.isin(self.ids, ids))
        merged_ids = torch.cat([self.ids[keep], ids])
        merged = torch.cat([self.weight[:-1][keep], weight.to(self.weight.dtype)])
        order = torch.argsort(merged_ids)
        self.ids = merged_ids[order].contiguous()
        self.weight = torch.cat([merged[order], self.weight[-1:]])
        self.checkpoint = checkpoint

    def index(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row in `weight` (same shape as `ids`); the last, zero row for an unknown id."""
        count = self.ids.shape[0]
        if count == 0:
            return torch.zeros_like(ids)
        at = torch.searchsorted(self.ids, ids).clamp(max=count - 1)
        return torch.where(self.ids[at] == ids, at, count)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.index(ids), self.weight)
