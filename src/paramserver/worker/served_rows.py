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

    def __init__(self, ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        order = torch.argsort(ids)
        zero = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        self.register_buffer("ids", ids[order].contiguous())
        self.register_buffer("weight", torch.cat([weight[order], zero]).to(dtype))

    def index(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's row in `weight` (same shape as `ids`); the last, zero row for an unknown id."""
        count = self.ids.shape[0]
        if count == 0:
            return torch.zeros_like(ids)
        at = torch.searchsorted(self.ids, ids).clamp(max=count - 1)
        return torch.where(self.ids[at] == ids, at, count)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.index(ids), self.weight)
