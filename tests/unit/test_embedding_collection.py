"""HashEmbeddingBagCollection: many tables in one module, against torch's EmbeddingBag per feature,
and looked up in one request per shard."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_hash_embedding import record_calls
from test_hash_embedding_bag import KJT

import paramserver as ps
from paramserver.tables.embedding_table import initial_rows

VOCAB, DIM, BATCH = 40, 4, 6


def configs():
    return [
        ps.nn.TableConfig("user", DIM, std=0.1),
        ps.nn.TableConfig("item", DIM, features=["clicked", "viewed"], mode="mean", std=0.1),
        ps.nn.TableConfig("site", 2, mode="max", std=0.1),
    ]


def jagged_batch(seed, features=("user", "clicked", "viewed", "site"), weights=False):
    """A KeyedJaggedTensor stand-in of BATCH examples (0-3 ids per feature and example), and the same
    as a dict of (values, offsets[, weights]) by feature."""
    g = torch.Generator().manual_seed(seed)
    values, offsets, per_feature = [], [0], {}
    for _ in features:
        lengths = torch.randint(0, 4, (BATCH,), generator=g)
        ids = torch.randint(0, VOCAB, (int(lengths.sum()),), generator=g)
        values.append(ids)
        offsets.extend((offsets[-1] + lengths.cumsum(0)).tolist())
    values = torch.cat(values)
    w = torch.rand(values.shape[0], generator=g) if weights else None
    kjt = KJT(list(features), values, torch.tensor(offsets), w)
    for k, f in enumerate(features):
        own = torch.tensor(offsets[k * BATCH: (k + 1) * BATCH + 1])
        part = (values[own[0]:own[-1]], own[:-1] - own[0])
        per_feature[f] = part if w is None else (*part, w[own[0]:own[-1]])
    return kjt, per_feature


def torch_bag(mode, dim):
    ref = torch.nn.EmbeddingBag(VOCAB, dim, mode=mode)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(
            initial_rows(np.arange(VOCAB, dtype=np.int64), dim, {"kind": "normal", "std": 0.1})))
    return ref


@pytest.mark.parametrize("form", ["kjt", "dict"])
def test_one_call_pools_every_feature_as_torch_embedding_bag_on_the_same_rows(form, fresh_context):
    ps.init(num_ps=2)
    collection = ps.nn.HashEmbeddingBagCollection(configs())
    ps.optim.SGD(collection.parameters(), lr=0.1)
    kjt, per_feature = jagged_batch(1)
    out = collection(kjt if form == "kjt" else per_feature)
    assert list(out) == ["user", "clicked", "viewed", "site"]
    modes = {"user": ("sum", DIM), "clicked": ("mean", DIM), "viewed": ("mean", DIM), "site": ("max", 2)}
    for feature, (mode, dim) in modes.items():
        ids, offsets = per_feature[feature]
        assert torch.equal(out[feature].detach(), torch_bag(mode, dim)(ids, offsets).detach()), feature


def test_weighted_features_and_fixed_bags_in_a_dict(fresh_context):
    ps.init()
    collection = ps.nn.HashEmbeddingBagCollection([ps.nn.TableConfig("a", DIM, std=0.1),
                                                   ps.nn.TableConfig("b", DIM, std=0.1)])
    ps.optim.SGD(collection.parameters(), lr=0.1)
    kjt, per_feature = jagged_batch(2, features=("a",), weights=True)
    fixed = torch.tensor([[1, 2], [3, 3], [0, 9]])
    out = collection({"a": per_feature["a"], "b": fixed})
    ids, offsets, weights = per_feature["a"]
    assert torch.equal(out["a"].detach(), torch_bag("sum", DIM)(ids, offsets, per_sample_weights=weights).detach())
    assert torch.equal(out["b"].detach(), torch_bag("sum", DIM)(fixed).detach())


def test_a_forward_looks_every_table_up_in_one_request_per_shard(fresh_context):
    ctx = ps.init(num_ps=3)
    tables = [ps.nn.TableConfig(f"c{i}", 2, std=0.1) for i in range(26)]  # Criteo's 26 features
    collection = ps.nn.HashEmbeddingBagCollection(tables)
    ps.optim.SGD(collection.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    batch = {f"c{i}": torch.randint(0, 1000, (64,), generator=g) for i in range(26)}
    methods = record_calls(ctx)
    out = collection(batch)
    assert methods == ["PushPull"] * 3  # one per shard, all 26 tables in it
    for i in (0, 25):  # and each table's rows are its own
        ids = batch[f"c{i}"]
        rows = initial_rows(ids.numpy(), 2, {"kind": "normal", "std": 0.1})
        assert torch.equal(out[f"c{i}"].detach(), torch.from_numpy(rows))


class CTR(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse = ps.nn.HashEmbeddingBagCollection(configs())
        torch.manual_seed(0)
        self.head = torch.nn.Linear(3 + 3 * DIM + 2, 1)

    def forward(self, dense, sparse):
        pooled = self.sparse(sparse)
        return self.head(torch.cat([dense, *pooled.values()], dim=1)).squeeze(1)


def ctr_batches(steps):
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(BATCH, 3, generator=g), jagged_batch(10 + s)[0], torch.randn(BATCH, generator=g))
            for s in range(steps)]


def test_trainer_trains_the_collection_with_one_request_per_shard_per_step(fresh_context):
    """The pipeline prefetches every table of the collection with the step: after the first batch,
    a step is one PushPull per shard, lookups and gradients of all tables in it."""
    ctx = ps.init(num_ps=2)
    model = CTR()
    opt = ps.optim.Adam(model.named_parameters(), lr=0.05)
    data = ctr_batches(6)
    methods = record_calls(ctx)
    ps.Trainer(model, opt, F.mse_loss, verbose=False).fit(data)
    assert methods.count("PushPull") == 2 * 6 + 2  # 6 steps, and the first batch's lookup
    assert set(methods) == {"PushPull", "Leave"}  # no Lookup; Leave: this worker finished its data
    opt.pull()
    trained = model.sparse.tables["item"].lookup(torch.arange(VOCAB)).detach()
    fresh = torch.from_numpy(initial_rows(np.arange(VOCAB, dtype=np.int64), DIM, {"kind": "normal", "std": 0.1}))
    assert not torch.equal(trained, fresh)


def test_the_pipelined_collection_trains_as_the_unpipelined_one(fresh_context):
    """Prefetched rows are the rows a lookup at the forward reads (exact mode): the same model, bit for bit."""
    results = []
    for prefetch in (True, False):
        ctx = ps.init(num_ps=2)
        model = CTR()
        opt = ps.optim.Adam(model.named_parameters(), lr=0.05)
        for dense, sparse, y in ctx.resumable(ctr_batches(5), prefetch_rows=prefetch):
            opt.zero_grad()
            F.mse_loss(model(dense, sparse), y).backward()
            opt.step()
        opt.pull()
        results.append(torch.cat([model.sparse.tables[t].lookup(torch.arange(VOCAB)).detach().flatten()
                                  for t in ("user", "item", "site")] + [model.head.weight.detach().flatten()]))
        ctx.shutdown()
    assert torch.equal(*results)


@pytest.mark.parametrize("features, message", [
    ({"user": torch.tensor([1]), "clicked": torch.tensor([1]), "viewed": torch.tensor([1])}, "missing \\['site'\\]"),
    ({"user": torch.tensor([1]), "clicked": torch.tensor([1]), "viewed": torch.tensor([1]), "site": torch.tensor([1]),
      "age": torch.tensor([1])}, "unknown \\['age'\\]"),
    ({"user": (torch.tensor([1, 2]), torch.tensor([0, 3])), "clicked": torch.tensor([1]), "viewed": torch.tensor([1]),
      "site": torch.tensor([1])}, "feature 'user': offsets go to 3"),
    (torch.tensor([1, 2]), "a KeyedJaggedTensor or a dict by feature"),
])
def test_bad_features_are_refused_by_name_before_any_lookup(features, message, fresh_context):
    ctx = ps.init()
    collection = ps.nn.HashEmbeddingBagCollection(configs())
    ps.optim.SGD(collection.parameters(), lr=0.1)
    methods = record_calls(ctx)
    with pytest.raises(ps.InvalidArgumentError, match=message):
        collection(features)
    assert methods == []


def test_bad_configs_are_refused():
    with pytest.raises(ps.InvalidArgumentError, match="feature 'x' is in two tables"):
        ps.nn.HashEmbeddingBagCollection([ps.nn.TableConfig("a", 2, features=["x"]),
                                          ps.nn.TableConfig("b", 2, features=["x"])])
    with pytest.raises(ps.InvalidArgumentError, match="distinct"):
        ps.nn.HashEmbeddingBagCollection([ps.nn.TableConfig("a", 2), ps.nn.TableConfig("a", 2)])
    with pytest.raises(ps.InvalidArgumentError, match="at least one"):
        ps.nn.HashEmbeddingBagCollection([])
