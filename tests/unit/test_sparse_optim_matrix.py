"""Tables (HashEmbedding) trained by paramserver.optim against nn.Embedding(sparse=True) trained by
torch's sparse optimizers: torch's SparseAdam matrix, Adagrad's lr_decay and maximize, with 1, 2
and 3 shards and batches so small that most steps send no id to some shard."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver.tables.embedding_table import initial_rows

VOCAB, DIM = 30, 4

# (paramserver optimizer, torch's sparse optimizer for the table, arguments)
CASES = [
    ("Adam", torch.optim.SparseAdam, {}),
    ("Adam", torch.optim.SparseAdam, {"lr": 0.01}),
    ("Adam", torch.optim.SparseAdam, {"lr": torch.tensor(0.001)}),
    ("Adam", torch.optim.SparseAdam, {"maximize": True}),
    ("Adam", torch.optim.SparseAdam, {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6}),
    ("Adagrad", torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.5}),
    ("Adagrad", torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1, "maximize": True}),
    ("SGD", torch.optim.SGD, {"lr": 0.1, "maximize": True}),
]


def _batches(steps: int, ids_per_step: int):
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, VOCAB, (ids_per_step,), generator=g), torch.randn(ids_per_step, DIM, generator=g))
            for _ in range(steps)]


def _reference_table() -> torch.nn.Embedding:
    table = torch.nn.Embedding(VOCAB, DIM, sparse=True)
    with torch.no_grad():
        table.weight.copy_(torch.from_numpy(initial_rows(np.arange(VOCAB, dtype=np.int64), DIM,
                                                         {"kind": "normal", "std": 0.1})))
    return table


@pytest.mark.parity  # 24 table trainings on both sides
@pytest.mark.parametrize("num_ps", [1, 2, 3])
@pytest.mark.parametrize("kind, torch_cls, kwargs", CASES, ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_a_table_equals_torch_sparse_training_for_any_number_of_shards(kind, torch_cls, kwargs, num_ps,
                                                                       fresh_context):
    ps.init(num_ps=num_ps)
    table = ps.nn.HashEmbedding(DIM, std=0.1)
    opt = getattr(ps.optim, kind)(table.parameters(), **kwargs)
    reference = _reference_table()
    opt_torch = torch_cls(reference.parameters(), **kwargs)
    for ids, target in _batches(50, ids_per_step=2):  # 2 ids, 3 shards: a shard misses most steps
        for module, optimizer in ((table, opt), (reference, opt_torch)):
            optimizer.zero_grad()
            F.mse_loss(module(ids), target).backward()
            optimizer.step()
    ours = table.lookup(torch.arange(VOCAB)).detach()
    theirs = reference.weight.detach()
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5


@pytest.mark.parametrize("kind, kwargs, option", [
    ("Adagrad", {"weight_decay": 0.1}, "weight_decay"),
    ("Adam", {"weight_decay": 0.1}, "weight_decay"),
    ("Adam", {"amsgrad": True}, "amsgrad"),
    ("AdamW", {}, "weight_decay"),  # AdamW decays by default; SparseAdam has no decay
    ("SGD", {"lr": 0.1, "momentum": 0.9}, "momentum"),
    ("SGD", {"lr": 0.1, "weight_decay": 0.1}, "weight_decay"),
])
def test_options_a_table_cannot_apply_are_refused_before_anything_is_registered(kind, kwargs, option, fresh_context):
    ps.init(num_ps=2)
    model = torch.nn.Sequential(ps.nn.HashEmbedding(DIM), torch.nn.Linear(DIM, 1))
    with pytest.raises(ValueError, match=f"{option}=.*cannot update a table row by row"):
        getattr(ps.optim, kind)(model.parameters(), **kwargs)
    assert all(stats["tables"] == {} for stats in ps.current_context().shard_stats())
    # the way out the message gives: a group without the option for the embeddings
    groups = [{"params": model[0].parameters(), option: 0}, {"params": model[1].parameters()}]
    getattr(ps.optim, kind)(groups, **kwargs)
    assert all(len(stats["tables"]) == 1 for stats in ps.current_context().shard_stats())


@pytest.mark.parametrize("mode", ["sync", "ssp:1"])
@pytest.mark.parametrize("kind, torch_cls, kwargs", [CASES[1], CASES[5]], ids=["adam", "adagrad-lr_decay"])
def test_table_steps_count_as_torch_counts_them_in_every_mode(kind, torch_cls, kwargs, mode, fresh_context):
    ps.init(num_ps=3)
    ps.set_mode(mode)
    table = ps.nn.HashEmbedding(DIM, std=0.1)
    opt = getattr(ps.optim, kind)(table.parameters(), **kwargs)
    reference = _reference_table()
    opt_torch = torch_cls(reference.parameters(), **kwargs)
    for ids, target in _batches(30, ids_per_step=1):
        for module, optimizer in ((table, opt), (reference, opt_torch)):
            optimizer.zero_grad()
            F.mse_loss(module(ids), target).backward()
            optimizer.step()
    ours = table.lookup(torch.arange(VOCAB)).detach()
    assert ((ours - reference.weight).norm() / reference.weight.norm()).item() < 1e-5
    assert [stats["tables"][table.table_name]["updates"] for stats in ps.current_context().shard_stats()] == [30] * 3
