"""Tables (HashEmbedding) beside nn.Embedding(sparse=True) and torch's sparse optimizers: options a table
cannot apply are refused before anything is registered, and a table's steps count as torch counts them.
The training matrix with 1, 2 and 3 shards is tests/integration/test_sparse_optim_parity.py."""

import pytest
import torch
import torch.nn.functional as F
from tests.sparse_reference import CASES, DIM, VOCAB, reference_table, table_batches

import paramserver as ps


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
    reference = reference_table()
    opt_torch = torch_cls(reference.parameters(), **kwargs)
    for ids, target in table_batches(30, ids_per_step=1):
        for module, optimizer in ((table, opt), (reference, opt_torch)):
            optimizer.zero_grad()
            F.mse_loss(module(ids), target).backward()
            optimizer.step()
    ours = table.lookup(torch.arange(VOCAB)).detach()
    assert ((ours - reference.weight).norm() / reference.weight.norm()).item() < 1e-5
    assert [stats["tables"][table.table_name]["updates"] for stats in ps.current_context().shard_stats()] == [30] * 3
