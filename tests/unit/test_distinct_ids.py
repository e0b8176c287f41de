"""A batch's distinct ids and the per-id gradient sums, on the C kernels and on numpy/torch."""

import numpy as np
import pytest
import torch

from paramserver.base.hashing import count_distinct, distinct
from paramserver.nn.distinct_ids import SpreadRows, sum_rows


@pytest.mark.parametrize("ids", [
    np.random.default_rng(0).zipf(1.2, 5000).astype(np.int64),  # many repeats
    np.array([5, -3, 5, np.iinfo(np.int64).min, np.iinfo(np.int64).max, -3], np.int64),
    np.array([7], np.int64),
    np.zeros(0, np.int64),
])
def test_distinct_gives_each_id_once_and_where_every_id_went(ids, both_kernel_paths):
    unique, inverse = distinct(ids)
    np.testing.assert_array_equal(np.sort(unique), np.unique(ids))
    np.testing.assert_array_equal(unique[inverse], ids)
    assert inverse.dtype == np.int64 and inverse.shape == ids.shape
    assert count_distinct(ids) == np.unique(ids).shape[0]  # a shard's check that a push names each id once


def test_spread_rows_backward_sums_the_gradient_of_each_distinct_id_as_torch_indexing_does(both_kernel_paths):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (3000,), generator=g).numpy()
    unique, inverse = distinct(ids)
    rows = torch.randn(unique.shape[0], 16, generator=g)
    upstream = torch.randn(ids.shape[0], 16, generator=g)
    ours, reference = rows.clone().requires_grad_(True), rows.clone().requires_grad_(True)
    SpreadRows.apply(ours, torch.from_numpy(inverse)).backward(upstream)
    reference[torch.from_numpy(inverse)].backward(upstream)
    torch.testing.assert_close(ours.grad, reference.grad, rtol=1e-5, atol=1e-5)


def test_sum_rows_takes_a_strided_gradient(both_kernel_paths):
    grads = torch.arange(24, dtype=torch.float32).view(4, 6)[:, ::2]  # not contiguous
    summed = sum_rows(grads, torch.tensor([1, 0, 1, 1]), 2)
    torch.testing.assert_close(summed, torch.stack([grads[1], grads[0] + grads[2] + grads[3]]))
