"""HashEmbeddingBag's input forms (jagged ids + offsets, per-sample weights, padded with a mask,
a KeyedJaggedTensor), each against torch.nn.EmbeddingBag on the same rows."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver.tables.embedding_table import initial_rows

VOCAB, DIM = 30, 4
INIT = {"kind": "normal", "std": 0.1}


class KJT:
    """A stand-in for torchrec's KeyedJaggedTensor: its four methods, key-major values."""

    def __init__(self, keys, values, offsets, weights=None):
        self._keys, self._values, self._offsets, self._weights = keys, values, offsets, weights

    def keys(self):
        return self._keys

    def values(self):
        return self._values

    def offsets(self):
        return self._offsets

    def weights_or_none(self):
        return self._weights


def reference(mode, include_last_offset=False):
    """torch's EmbeddingBag holding the rows a fresh table gives ids 0..VOCAB-1."""
    ref = torch.nn.EmbeddingBag(VOCAB, DIM, mode=mode, include_last_offset=include_last_offset,
                                   sparse=mode != "max")  # torch has no sparse max
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(initial_rows(np.arange(VOCAB, dtype=np.int64), DIM, INIT)))
    return ref


def jagged(seed=3, bags=6):
    """Ids of `bags` bags of 0-4 ids each (an empty one among them), and where each bag starts."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (bags,), generator=g)
    lengths[2] = 0
    ids = torch.randint(0, VOCAB, (int(lengths.sum()),), generator=g)
    return ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])


def train_both(bag, ref, inputs, steps=5):
    """SGD on both sides over the same inputs: the first forward equal bit for bit (the same rows), the
    trained rows within float32 rounding (the PS's update sums a row's gradients in its own order)."""
    opt = ps.optim.SGD(bag.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    target = torch.randn(inputs.get("offsets", inputs["input"]).shape[0] - (1 if "last" in inputs else 0), DIM)
    kwargs = {k: v for k, v in inputs.items() if k != "last"}
    for step in range(steps):
        ours, theirs = bag(**kwargs), ref(**kwargs)
        if step == 0:
            assert torch.equal(ours.detach(), theirs.detach())
        assert torch.allclose(ours.detach(), theirs.detach(), atol=1e-6, rtol=0)
        for o, out in ((opt, ours), (ref_opt, theirs)):
            o.zero_grad()
            F.mse_loss(out, target).backward()
            o.step()
    opt.pull()
    ours = bag.lookup(torch.arange(VOCAB)).detach()
    assert torch.allclose(ours, ref.weight.detach(), atol=1e-6, rtol=0)
    assert not torch.equal(ref.weight.detach(), reference("sum").weight.detach())  # it did train


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("last", [False, True])
def test_jagged_ids_with_offsets_pool_and_train_as_torch_embedding_bag(mode, last, fresh_context):
    ps.init(num_ps=2)
    ids, offsets = jagged()
    if last:
        offsets = torch.cat([offsets, torch.tensor([ids.shape[0]])])
    bag = ps.nn.HashEmbeddingBag(DIM, mode=mode, include_last_offset=last, std=0.1)
    inputs = {"input": ids, "offsets": offsets, **({"last": True} if last else {})}
    train_both(bag, reference(mode, last), inputs)


def test_per_sample_weights_weigh_each_id_as_in_torch(fresh_context):
    ps.init(num_ps=2)
    ids, offsets = jagged(seed=4)
    weights = torch.rand(ids.shape[0], generator=torch.Generator().manual_seed(5))
    bag = ps.nn.HashEmbeddingBag(DIM, mode="sum", std=0.1)
    train_both(bag, reference("sum"), {"input": ids, "offsets": offsets, "per_sample_weights": weights})


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_fixed_length_bags_pool_as_torch(mode, fresh_context):
    ps.init()
    ids = torch.randint(0, VOCAB, (5, 3), generator=torch.Generator().manual_seed(6))
    bag = ps.nn.HashEmbeddingBag(DIM, mode=mode, std=0.1)
    train_both(bag, reference(mode), {"input": ids})


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_padded_bags_with_a_mask_equal_the_same_bags_jagged(mode, fresh_context):
    ps.init()
    ids = torch.tensor([[3, 7, 0], [5, 5, 9], [1, 0, 0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    bag = ps.nn.HashEmbeddingBag(DIM, mode=mode, std=0.1)
    ps.optim.SGD(bag.parameters(), lr=0.1)
    ours = bag(ids, mask=mask)
    theirs = reference(mode)(torch.tensor([3, 7, 5, 5, 9]), torch.tensor([0, 2, 5]))
    assert torch.equal(ours.detach(), theirs.detach())
    assert torch.equal(bag(ids, mask).detach(), theirs.detach())  # the older positional form
    assert torch.equal(ours[2].detach(), torch.zeros(DIM))  # an empty bag: zeros, as torch


def test_a_one_feature_keyed_jagged_tensor_is_its_values_offsets_and_weights(fresh_context):
    ps.init(num_ps=2)
    ids, offsets = jagged(seed=7)
    weights = torch.rand(ids.shape[0])
    full = torch.cat([offsets, torch.tensor([ids.shape[0]])])
    bag = ps.nn.HashEmbeddingBag(DIM, mode="sum", std=0.1)
    ps.optim.SGD(bag.parameters(), lr=0.1)
    ours = bag(KJT(["f"], ids, full, weights))
    theirs = reference("sum")(ids, offsets, per_sample_weights=weights)
    assert torch.equal(ours.detach(), theirs.detach())


@pytest.mark.parametrize("call, message", [
    (lambda bag: bag(torch.tensor([1, 2, 3])), "1-D ids need offsets"),
    (lambda bag: bag(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1])), "never decrease"),
    (lambda bag: bag(torch.tensor([1, 2, 3]), torch.tensor([0, 5])), "past the 3 ids"),
    (lambda bag: bag(torch.tensor([[1, 2]]), torch.tensor([0])), "offsets must be None"),
    (lambda bag: bag(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(3)), "per_sample_weights has shape"),
    (lambda bag: bag(KJT(["a", "b"], torch.tensor([1]), torch.tensor([0, 1, 1]))), "HashEmbeddingBagCollection"),
    (lambda bag: bag(torch.tensor([[1.0]])), "must be integers"),
])
def test_bad_input_is_refused_by_name_before_any_lookup(call, message, fresh_context):
    ps.init()
    bag = ps.nn.HashEmbeddingBag(DIM, std=0.1)
    ps.optim.SGD(bag.parameters(), lr=0.1)
    with pytest.raises(ps.InvalidArgumentError, match=message):
        call(bag)
    assert bag._pending == []


def test_per_sample_weights_need_sum_mode(fresh_context):
    ps.init()
    bag = ps.nn.HashEmbeddingBag(DIM, mode="mean")
    ps.optim.SGD(bag.parameters(), lr=0.1)
    with pytest.raises(ps.InvalidArgumentError, match="need mode 'sum'"):
        bag(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2))
    with pytest.raises(ps.InvalidArgumentError, match="'sum', 'mean' or 'max'"):
        ps.nn.HashEmbeddingBag(DIM, mode="median")


def test_trainer_prefetches_a_keyed_jagged_tensor_bag_with_the_step(fresh_context):
    """The pipeline finds the KeyedJaggedTensor in the batch and prefetches its values: after the
    first batch, no lookup of its own."""
    from test_hash_embedding import record_calls

    ctx = ps.init(num_ps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(ps.nn.HashEmbeddingBag(DIM, std=0.1), torch.nn.Linear(DIM, 1), torch.nn.Flatten(0))
    opt = ps.optim.SGD(model.parameters(), lr=0.1)
    data = []
    for seed in range(4):
        ids, offsets = jagged(seed=seed)
        data.append((KJT(["f"], ids, torch.cat([offsets, torch.tensor([ids.shape[0]])])), torch.randn(6)))
    methods = record_calls(ctx)
    history = ps.Trainer(model, opt, F.mse_loss, verbose=False).fit(data)
    assert history[0].steps == 4
    assert methods.count("Lookup") == 2 and methods.count("PushPull") == 4 * 2  # the first batch's lookup only
