"""HashEmbedding modules with PS optimizers, against torch's nn.Embedding(sparse=True)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver.tables.embedding_table import initial_rows

VOCAB, DIM = 40, 8


class Model(torch.nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.embedding = embedding
        torch.manual_seed(0)
        self.head = torch.nn.Linear(2 * DIM, 1)

    def forward(self, ids):
        return self.head(self.embedding(ids).flatten(1)).squeeze(1)


def data(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (16, 2), generator=g), torch.randn(16, generator=g)) for _ in range(steps)]


@pytest.mark.parametrize("kind, dense_cls, sparse_cls, kwargs", [
    ("Adam", torch.optim.Adam, torch.optim.SparseAdam, {"lr": 0.01}),
    ("Adagrad", torch.optim.Adagrad, torch.optim.Adagrad, {"lr": 0.05}),
    ("SGD", torch.optim.SGD, torch.optim.SGD, {"lr": 0.1}),
])
def test_dense_and_sparse_parameters_in_one_ps_optimizer_equal_torch(kind, dense_cls, sparse_cls, kwargs,
                                                                     fresh_context):
    ps.init(num_ps=3)
    model = Model(ps.nn.HashEmbedding(DIM, std=0.1))
    opt = getattr(ps.optim, kind)(model.named_parameters(), **kwargs)
    reference = Model(torch.nn.Embedding(VOCAB, DIM, sparse=True))
    with torch.no_grad():
        reference.embedding.weight.copy_(torch.from_numpy(
            initial_rows(np.arange(VOCAB, dtype=np.int64), DIM, {"kind": "normal", "std": 0.1})))
    ref_dense = dense_cls(reference.head.parameters(), **kwargs)
    ref_sparse = sparse_cls(reference.embedding.parameters(), **kwargs)
    for ids, target in data(40):
        for m, opts in ((model, [opt]), (reference, [ref_dense, ref_sparse])):
            for o in opts:
                o.zero_grad()
            F.mse_loss(m(ids), target).backward()
            for o in opts:
                o.step()
    opt.pull()
    ours = model.embedding.lookup(torch.arange(VOCAB)).detach()
    theirs = reference.embedding.weight.detach()
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5
    assert ((model.head.weight - reference.head.weight).norm() / reference.head.weight.norm()).item() < 1e-5


def test_embedding_bag_sums_or_averages_each_bag(fresh_context):
    ps.init()
    bag = ps.nn.HashEmbeddingBag(4, mode="mean", init="uniform", scale=0.5)
    ps.optim.SGD(bag.parameters(), lr=0.1)
    ids = torch.tensor([[1, 2, 3], [4, 4, 9]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rows = bag.lookup(torch.tensor([1, 2, 4, 9])).detach()
    out = bag(ids, mask).detach()
    torch.testing.assert_close(out[0], (rows[0] + rows[1]) / 2)
    torch.testing.assert_close(out[1], (2 * rows[2] + rows[3]) / 3)


@pytest.mark.parametrize("ids, fragment", [
    (torch.tensor([1.5, 2.0]), "must be integers"),
    (np.array([1.0, 2.0]), "must be integers"),
    (np.array([2**64 - 1], dtype=np.uint64), "overflow int64"),
    ([2**70], "overflow int64"),
])
def test_ids_that_are_not_int64_integers_are_refused(ids, fragment, fresh_context):
    ps.init()
    emb = ps.nn.HashEmbedding(4)
    ps.optim.SGD(emb.parameters(), lr=0.1)
    with pytest.raises(ps.InvalidArgumentError, match=fragment):
        emb(ids)


def test_forward_before_the_optimizer_is_a_clear_error(fresh_context):
    ps.init()
    with pytest.raises(ps.NotInitializedError, match="optimizer"):
        ps.nn.HashEmbedding(4)(torch.tensor([1]))


def test_a_table_can_carry_its_own_optimizer_and_policy(fresh_context):
    ctx = ps.init()
    wide = ps.nn.HashEmbedding(1, init="zeros", name="wide", policy={"admit_after": 2},
                               optimizer={"name": "ftrl", "hyper": {"lr": 0.5, "l1": 0.1}})
    opt = ps.optim.SGD(wide.parameters(), lr=0.1)
    ids = torch.tensor([3, 4])
    for _ in range(20):
        opt.zero_grad()
        ((wide(ids).squeeze(1) - torch.tensor([1.0, -1.0])) ** 2).sum().backward()
        opt.step()
    values = wide.lookup(ids).detach().squeeze(1)
    assert values[0] > 0.3 and values[1] < -0.3
    stats = ctx.shard_stats()[0]["tables"]["wide"]
    assert stats["admitted"] == 2 and stats["dropped_gradients"] == 2  # the first lookup only counted them


def test_a_table_looked_up_twice_in_a_step_gets_the_summed_gradient(fresh_context):
    ps.init(num_ps=2)
    emb = ps.nn.HashEmbedding(DIM, std=0.1)
    opt = ps.optim.SGD(emb.parameters(), lr=0.1)
    reference = torch.nn.Embedding(VOCAB, DIM, sparse=True)
    with torch.no_grad():
        reference.weight.copy_(torch.from_numpy(
            initial_rows(np.arange(VOCAB, dtype=np.int64), DIM, {"kind": "normal", "std": 0.1})))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for ids, _ in data(10):
        for module, o in ((emb, opt), (reference, ref_opt)):
            o.zero_grad()
            (module(ids[:, 0]).pow(2).sum() + module(ids[:, 1]).sum()).backward()  # overlapping ids
            o.step()
    ours = emb.lookup(torch.arange(VOCAB)).detach()
    assert ((ours - reference.weight.detach()).norm() / reference.weight.norm()).item() < 1e-5


def record_calls(ctx):
    """Wrap the context's shard channels so that every method called is recorded."""
    methods = []
    for channel in ctx.client.channels:
        call = channel.call

        def recording(method, *args, _call=call, **kwargs):
            methods.append(method)
            return _call(method, *args, **kwargs)
        channel.call = recording
    return methods


def train_step_with_prefetch(embedding, opt, batch, upcoming):
    opt.zero_grad()
    loss = embedding(batch).sum()
    embedding.prefetch(upcoming)  # as a training loop does, before the backward
    loss.backward()
    opt.step()


def test_prefetched_rows_ride_along_the_step_and_include_its_update(fresh_context):
    ctx = ps.init(num_ps=2)
    embedding = ps.nn.HashEmbedding(DIM, std=0.1)
    opt = ps.optim.SGD(embedding.parameters(), lr=1.0)
    first, upcoming = torch.tensor([[1, 2]]), torch.tensor([[2, 3]])  # id 2 in both batches
    before = embedding(upcoming).detach().clone()
    opt.zero_grad()
    loss = embedding(first).sum()
    embedding.prefetch(upcoming)  # as a training loop does, before the backward
    loss.backward()
    methods = record_calls(ctx)
    opt.step()  # moves row 2 by -1 in every column
    prefetched = embedding(upcoming).detach()
    assert methods == ["PushPull", "PushPull"]  # one request per shard: row gradients and lookup together
    torch.testing.assert_close(prefetched[0, 0], before[0, 0] - 1)  # read after this step's update
    torch.testing.assert_close(prefetched, embedding(upcoming.clone()).detach())  # = a plain lookup


def test_a_prefetch_is_used_by_the_same_ids_object_only(fresh_context):
    ctx = ps.init(num_ps=1)
    embedding = ps.nn.HashEmbedding(DIM, std=0.1)
    opt = ps.optim.SGD(embedding.parameters(), lr=1.0)
    first, upcoming = torch.tensor([[1, 2]]), torch.tensor([[2, 3]])
    embedding(first)
    train_step_with_prefetch(embedding, opt, first, upcoming)
    methods = record_calls(ctx)
    embedding(upcoming.clone())  # equal ids, another object: looked up anew, the prefetch dropped
    embedding(upcoming)
    assert methods == ["Lookup", "Lookup"]


def test_with_overlap_a_prefetch_rides_the_step_and_serves_the_batch_after_next(fresh_context):
    ctx = ps.init(num_ps=2)
    embedding = ps.nn.HashEmbedding(DIM, std=0.1)
    opt = ps.optim.SGD(embedding.parameters(), lr=1.0, overlap=True)
    b0, b1, b2 = torch.tensor([[1, 2]]), torch.tensor([[3, 7]]), torch.tensor([[2, 3]])
    before = embedding(b2).detach().clone()
    opt.zero_grad()
    loss = embedding(b0).sum()
    embedding.prefetch(b2)  # two batches ahead: the step's reply is read at the next step
    loss.backward()
    methods = record_calls(ctx)
    opt.step()  # moves rows 1 and 2 by -1
    assert methods == ["PushPull", "PushPull"]  # one request per shard: row gradients and lookup together
    opt.zero_grad()
    embedding(b1).sum().backward()
    opt.step()  # reads the first step's reply (b2's rows), then moves rows 3 and 7
    methods.clear()
    prefetched = embedding(b2).detach()
    assert methods == []  # the forward used the rows that came back
    torch.testing.assert_close(prefetched[0, 0], before[0, 0] - 1)  # row 2: read after the first update
    torch.testing.assert_close(prefetched[0, 1], before[0, 1])  # row 3: one update staler
    opt.synchronize()
    torch.testing.assert_close(embedding(b2.clone()).detach()[0, 1], before[0, 1] - 1)


def test_with_overlap_a_prefetch_for_the_next_batch_is_looked_up_at_its_forward(fresh_context):
    ctx = ps.init(num_ps=2)
    embedding = ps.nn.HashEmbedding(DIM, std=0.1)
    opt = ps.optim.SGD(embedding.parameters(), lr=1.0, overlap=True)
    first, upcoming = torch.tensor([[1, 2]]), torch.tensor([[2, 3]])
    train_step_with_prefetch(embedding, opt, first, upcoming)  # rides this step, whose reply is read later
    methods = record_calls(ctx)
    rows = embedding(upcoming).detach()
    assert methods and set(methods) == {"Lookup"}  # the rows are not back yet: looked up at once
    torch.testing.assert_close(rows, embedding(upcoming.clone()).detach())


def train_ctr_like(prefetch: bool) -> torch.Tensor:
    ps.init(num_ps=2)
    model = Model(ps.nn.HashEmbedding(DIM, std=0.1))
    opt = ps.optim.Adam(model.named_parameters(), lr=0.05)
    batches = data(12)
    for (ids, target), (upcoming, _) in zip(batches, batches[1:] + [(None, None)]):
        opt.zero_grad()
        loss = F.mse_loss(model(ids), target)
        if prefetch and upcoming is not None:
            model.embedding.prefetch(upcoming)
        loss.backward()
        opt.step()
    rows = model.embedding.lookup(torch.arange(VOCAB)).detach().clone()
    ps.current_context().shutdown()
    return torch.cat([rows.flatten(), model.head.weight.detach().flatten()])


def test_prefetching_the_next_batches_rows_changes_no_result_of_one_worker(fresh_context):
    torch.testing.assert_close(train_ctr_like(prefetch=True), train_ctr_like(prefetch=False), rtol=0, atol=0)
