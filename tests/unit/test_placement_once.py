"""A batch's ids are hashed to shards once, at the lookup; the push of its gradients reuses the placement.
(That training still equals torch's on several shards: tests/unit/test_hash_embedding.py.)"""

import numpy as np
import torch

import paramserver as ps
from paramserver.client import table_client
from paramserver.join import join


def test_each_batch_is_hashed_once(monkeypatch, fresh_context):
    hashed = []
    real = table_client.shard_of

    def counting(ids, num_shards):
        hashed.append(ids.shape[0])
        return real(ids, num_shards)

    monkeypatch.setattr(table_client, "shard_of", counting)
    ctx = join(None, num_ps=2)
    table = ps.nn.HashEmbedding(4)
    opt = ps.optim.Adagrad(table.parameters(), lr=0.1)
    for ids in [torch.tensor([[1, 5, 9], [5, 7, 1]]), torch.tensor([[2, 2, 3]]), torch.tensor([[9, 11, 13]])]:
        opt.zero_grad()
        table(ids).sum().backward()
        opt.step()
    assert hashed == [4, 2, 3]  # the distinct ids of each batch, once: lookup and push share it
    writable = np.array([1, 2], np.int64)  # an array the caller may change: placed at every call
    ctx.tables.lookup(table.table_name, writable)
    ctx.tables.lookup(table.table_name, writable)
    assert hashed[3:] == [2, 2]
