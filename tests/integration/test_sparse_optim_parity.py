"""Tables (HashEmbedding) trained by paramserver.optim against nn.Embedding(sparse=True) trained by
torch's sparse optimizers: torch's SparseAdam matrix, Adagrad's lr_decay and maximize, with 1, 2
and 3 shards and batches so small that most steps send no id to some shard."""

import pytest
import torch
import torch.nn.functional as F
from tests.sparse_reference import CASES, DIM, VOCAB, reference_table, table_batches

import paramserver as ps


@pytest.mark.parity  # 24 table trainings on both sides
@pytest.mark.parametrize("num_ps", [1, 2, 3])
@pytest.mark.parametrize("kind, torch_cls, kwargs", CASES, ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_a_table_equals_torch_sparse_training_for_any_number_of_shards(kind, torch_cls, kwargs, num_ps,
                                                                       fresh_context):
    ps.init(num_ps=num_ps)
    table = ps.nn.HashEmbedding(DIM, std=0.1)
    opt = getattr(ps.optim, kind)(table.parameters(), **kwargs)
    reference = reference_table()
    opt_torch = torch_cls(reference.parameters(), **kwargs)
    for ids, target in table_batches(50, ids_per_step=2):  # 2 ids, 3 shards: a shard misses most steps
        for module, optimizer in ((table, opt), (reference, opt_torch)):
            optimizer.zero_grad()
            F.mse_loss(module(ids), target).backward()
            optimizer.step()
    ours = table.lookup(torch.arange(VOCAB)).detach()
    theirs = reference.weight.detach()
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5
