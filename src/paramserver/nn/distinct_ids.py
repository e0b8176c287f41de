"""Gradients summed per distinct id, and rows spread back over the batch: the two ends of a lookup.

A forward looks up each distinct id once (`base.hashing.distinct`) and spreads the rows back
over the batch; the backward sums the gradient rows of each distinct id. Both run as one C loop when the kernels
were built (paramserver.base.kernels), numpy/torch otherwise. Thread-safe (no shared state).
"""

from __future__ import annotations

import torch

from paramserver.base import kernels


def sum_rows(grads: torch.Tensor, inverse: torch.Tensor, count: int) -> torch.Tensor:
    """(count x dim): row k is the sum of the rows i of `grads` (float32, CPU) with inverse[i] == k."""
    out = torch.zeros(count, grads.shape[1])
    grads, inverse = grads.contiguous(), inverse.contiguous()  # held here while the kernel reads them
    if kernels.KERNELS is None or grads.dtype != torch.float32 or inverse.dtype != torch.int64:
        return out.index_add_(0, inverse, grads.to(out.dtype))
    kernels.KERNELS.ps_scatter_add_rows(
        grads.data_ptr(), inverse.data_ptr(), grads.shape[0], grads.shape[1], out.data_ptr()
    )
    return out


class SpreadRows(torch.autograd.Function):
    """rows (distinct ids x dim) -> rows[inverse]; its backward sums the gradient per distinct id
    (torch's indexing backward does the same with a generic, several times slower scatter)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.count = rows.shape[0]
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return sum_rows(grad, inverse, ctx.count), None
