"""Embedding tables on a shard: rows on first touch, and row-wise optimizers against torch's sparse ones."""

import numpy as np
import pytest
import torch

from paramserver.errors import InvalidArgumentError
from paramserver.server.embedding import EmbeddingTable, initial_rows
from paramserver.server.sparse_optimizers import build_sparse_optimizer


def table(name, hyper, dim=8, init=None):
    spec = {"name": name, "hyper": hyper}
    return EmbeddingTable("t", dim, build_sparse_optimizer(spec), init or {"kind": "normal", "std": 0.1}, spec,
                          capacity=4)


def test_rows_are_created_on_first_touch_with_an_id_determined_initial_value():
    t = table("sgd", {"lr": 0.1})
    ids = np.array([10**12, -5, 7], np.int64)
    first = t.read(ids)
    assert t.size == 3
    np.testing.assert_array_equal(first, initial_rows(ids, 8, {"kind": "normal", "std": 0.1}))
    np.testing.assert_array_equal(t.read(ids[::-1]), first[::-1])  # same rows, no new ones
    assert t.size == 3
    assert abs(initial_rows(np.arange(20000), 8, {"kind": "normal", "std": 0.1}).std() - 0.1) < 0.005


@pytest.mark.parametrize("name, torch_cls, hyper", [
    ("sgd", torch.optim.SGD, {"lr": 0.5}),
    ("adagrad", torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1}),
    ("adam", torch.optim.SparseAdam, {"lr": 0.01, "betas": (0.8, 0.99)}),
])
def test_row_wise_optimizers_equal_torch_on_a_sparse_embedding(name, torch_cls, hyper):
    vocab, dim = 50, 8
    t = table(name, hyper, dim)
    ids_all = np.arange(vocab, dtype=np.int64)
    reference = torch.nn.Embedding(vocab, dim, sparse=True)
    with torch.no_grad():
        reference.weight.copy_(torch.from_numpy(t.read(ids_all)))
    opt = torch_cls(reference.parameters(), **hyper)
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        batch = torch.randint(0, vocab, (32,), generator=g)  # repeated ids, as in real batches
        target = torch.randn(32, dim, generator=g)
        opt.zero_grad()
        ((reference(batch) - target) ** 2).sum().backward()
        grad = reference.weight.grad.coalesce()
        t.apply(grad.indices()[0].numpy().astype(np.int64), grad.values().numpy())
        opt.step()
    ours = torch.from_numpy(t.read(ids_all))
    assert ((ours - reference.weight.detach()).norm() / reference.weight.norm()).item() < 1e-5


def test_ftrl_drives_weights_of_weak_features_to_exact_zero_with_l1():
    t = table("ftrl", {"lr": 0.1, "l1": 1.0}, dim=1, init={"kind": "zeros"})
    ids = np.array([1, 2], np.int64)
    for _ in range(50):
        t.apply(ids, np.array([[-2.0], [-0.01]], np.float32))  # a strong and a weak signal
    values = t.read(ids)[:, 0]
    assert values[0] > 0 and values[1] == 0.0


def test_lazy_adam_with_per_row_steps_corrects_each_row_by_its_own_count():
    t = table("adam", {"lr": 0.1, "per_row_step": True}, dim=2, init={"kind": "zeros"})
    t.apply(np.array([1], np.int64), np.ones((1, 2), np.float32))
    t.apply(np.array([1, 2], np.int64), np.ones((2, 2), np.float32))
    rows = t.read(np.array([1, 2], np.int64))
    np.testing.assert_allclose(rows[1], [-0.1, -0.1], rtol=1e-5)  # row 2's first step: a full lr step
    np.testing.assert_allclose(rows[0], [-0.2, -0.2], rtol=1e-5)


def test_table_grows_past_its_capacity_keeping_rows_and_state():
    t = table("adagrad", {"lr": 0.1})
    first = np.arange(3, dtype=np.int64)
    t.apply(first, np.ones((3, 8), np.float32))
    before = t.read(first).copy()
    t.read(np.arange(3, 1000, dtype=np.int64))
    np.testing.assert_array_equal(t.read(first), before)
    assert t.size == 1000 and t.values.shape[0] >= 1000


@pytest.mark.parametrize("spec, fragment", [
    ({"name": "rmsprop"}, "unknown sparse optimizer"),
    ({"name": "adam", "hyper": {"momentum": 0.9}}, "unknown arguments"),
    ({"name": "sgd", "hyper": {"lr": -1}}, "invalid lr"),
])
def test_bad_sparse_optimizer_specs_are_clear_errors(spec, fragment):
    with pytest.raises(InvalidArgumentError, match=fragment):
        build_sparse_optimizer(spec)


def test_bad_table_arguments_are_clear_errors():
    opt = build_sparse_optimizer({"name": "sgd"})
    with pytest.raises(InvalidArgumentError, match="dim"):
        EmbeddingTable("t", 0, opt, {"kind": "zeros"}, {})
    with pytest.raises(InvalidArgumentError, match="initializer"):
        EmbeddingTable("t", 4, opt, {"kind": "xavier"}, {})
