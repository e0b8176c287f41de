"""Embedding tables on a shard: rows on first touch, and row-wise optimizers against torch's sparse ones."""

import numpy as np
import pytest
import torch

from paramserver.base.errors import InvalidArgumentError
from paramserver.tables.embedding_table import EmbeddingTable, RowPolicy, initial_rows
from paramserver.tables.sparse_optimizers import build_sparse_optimizer

pytestmark = pytest.mark.usefixtures("both_kernel_paths")


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
        t.read(ids)
        t.apply(ids, np.array([[-2.0], [-0.01]], np.float32))  # a strong and a weak signal
    values = t.read(ids)[:, 0]
    assert values[0] > 0 and values[1] == 0.0


def test_lazy_adam_with_per_row_steps_corrects_each_row_by_its_own_count():
    t = table("adam", {"lr": 0.1, "per_row_step": True}, dim=2, init={"kind": "zeros"})
    t.read(np.array([1, 2], np.int64))
    t.apply(np.array([1], np.int64), np.ones((1, 2), np.float32))
    t.apply(np.array([1, 2], np.int64), np.ones((2, 2), np.float32))
    rows = t.read(np.array([1, 2], np.int64))
    np.testing.assert_allclose(rows[1], [-0.1, -0.1], rtol=1e-5)  # row 2's first step: a full lr step
    np.testing.assert_allclose(rows[0], [-0.2, -0.2], rtol=1e-5)


def test_table_grows_past_its_capacity_keeping_rows_and_state():
    t = table("adagrad", {"lr": 0.1})
    first = np.arange(3, dtype=np.int64)
    t.read(first)
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


def policy_table(**policy):
    spec = {"name": "sgd", "hyper": {"lr": 1.0}}
    return EmbeddingTable("t", 2, build_sparse_optimizer(spec), {"kind": "zeros"}, spec, capacity=4,
                          policy=RowPolicy.from_dict(policy))


def test_an_id_is_admitted_on_its_c_th_lookup_and_its_gradients_dropped_until_then():
    t = policy_table(admit_after=3)
    ids = np.array([5], np.int64)
    for _ in range(2):
        np.testing.assert_array_equal(t.read(ids), [[0, 0]])  # the initial values, no row yet
        t.apply(ids, np.ones((1, 2), np.float32))
    assert t.size == 0 and t.counters["dropped_gradients"] == 2
    t.read(ids)
    t.apply(ids, np.ones((1, 2), np.float32))
    assert t.size == 1 and t.counters["admitted"] == 1
    np.testing.assert_array_equal(t.read(ids), [[-1, -1]])


def test_rows_unseen_for_ttl_steps_are_evicted_on_schedule_and_the_rest_kept():
    t = policy_table(ttl_steps=2, evict_every=4)
    old, hot = np.array([1], np.int64), np.array([2], np.int64)
    t.read(old)
    t.apply(old, np.ones((1, 2), np.float32))
    for _ in range(3):
        t.read(hot)
        t.apply(hot, np.ones((1, 2), np.float32))  # the 4th update runs the eviction pass
    assert t.size == 1 and t.counters["evicted"] == 1
    np.testing.assert_array_equal(t.read(hot), [[-3, -3]])
    np.testing.assert_array_equal(t.read(old), [[0, 0]])  # back as a fresh row


def test_at_capacity_the_least_recently_seen_rows_go():
    t = policy_table(max_rows=2)
    for i in range(4):
        t.read(np.array([i], np.int64))
        t.apply(np.array([i], np.int64), np.ones((1, 2), np.float32))
    assert t.evict() == 2
    assert sorted(t.index.items()[0].tolist()) == [2, 3]


def test_a_bad_row_policy_is_a_clear_error():
    with pytest.raises(InvalidArgumentError, match="unknown row policy"):
        RowPolicy.from_dict({"ttl": 3})
    with pytest.raises(InvalidArgumentError, match="invalid row policy"):
        RowPolicy.from_dict({"admit_probability": 0})


def test_c_kernels_and_numpy_give_the_same_initial_rows_and_updates(monkeypatch):
    from paramserver.base import kernels

    if kernels.KERNELS is None:
        pytest.skip("C kernels not built")
    ids = np.random.default_rng(3).integers(-(2**63), 2**63 - 1, 5000, dtype=np.int64)
    grads = np.random.default_rng(4).standard_normal((5000, 8)).astype(np.float32)
    results = {}
    for path in ("c", "numpy"):
        if path == "numpy":
            monkeypatch.setattr(kernels, "KERNELS", None)
        rows = {kind: initial_rows(ids, 8, {"kind": kind, "std": 0.1, "scale": 0.1}) for kind in ("normal", "uniform")}
        tables = {name: table(name, {"lr": 0.01}) for name in ("adam", "adagrad")}
        for t in tables.values():
            t.read(ids)
            for _ in range(3):
                t.apply(ids, grads)
        results[path] = rows, {name: t.read(ids) for name, t in tables.items()}
    for part in (0, 1):
        for key in results["c"][part]:
            np.testing.assert_allclose(results["c"][part][key], results["numpy"][part][key], rtol=1e-5, atol=1e-7)


def test_a_reserved_capacity_takes_that_many_rows_without_regrowing():
    from paramserver.tables.table_store import TableStore

    store = TableStore(0)
    store.register("t", 4, {"name": "sgd", "hyper": {"lr": 0.1}}, {"kind": "zeros"}, capacity=5000)
    values = store.table("t").values
    store.lookup("t", np.arange(5000, dtype=np.int64) * 31)
    assert store.table("t").values is values and store.table("t").size == 5000
    with pytest.raises(InvalidArgumentError, match="capacity -1"):
        store.register("u", 4, {"name": "sgd", "hyper": {"lr": 0.1}}, {"kind": "zeros"}, capacity=-1)
    assert "u" not in store.describe()


@pytest.fixture
def small_growth(monkeypatch):
    """Row arrays move to reserved address space from 4 KiB on, and the index grows a few slots
    per call, so small tables go through the reserved arrays and many index growths."""
    from paramserver.tables import embedding_table, hash_index

    monkeypatch.setattr(embedding_table, "_RESERVE_FROM", 4096)
    monkeypatch.setattr(hash_index, "_SHARE_MIN", 8)
    monkeypatch.setattr(hash_index, "_RESERVE_FROM", 64)


ADAGRAD_WARM = {"name": "adagrad", "hyper": {"lr": 0.1, "initial_accumulator_value": 0.25}}


def grown_and_reference(policy=None):
    def make(capacity):
        return EmbeddingTable("t", 4, build_sparse_optimizer(ADAGRAD_WARM), {"kind": "normal", "std": 0.1},
                              ADAGRAD_WARM, capacity=capacity, policy=RowPolicy.from_dict(policy))

    return make(4), make(1 << 15)


def feed(tables, rng, batches, space=6000):
    """The same reads and updates into each table; returns the ids touched."""
    touched = set()
    for _ in range(batches):
        ids = np.unique(rng.integers(0, space, int(rng.integers(1, 200)))).astype(np.int64)
        grads = rng.standard_normal((ids.size, 4)).astype(np.float32)
        for t in tables:
            t.read(ids)
            t.apply(ids, grads)
        touched.update(ids.tolist())
    return np.array(sorted(touched), np.int64)


def saved_rows(t):
    """Every row's arrays, keyed by id: what a checkpoint of the table holds."""
    chunks = [arrays for _, arrays in t.row_chunks(1000)]
    merged = {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0]}
    order = np.argsort(merged["ids"])
    return {name: array[order] for name, array in merged.items()}


def test_a_table_grown_through_many_index_growths_keeps_every_row_and_its_state(small_growth):
    grown, reference = grown_and_reference()
    rng = np.random.default_rng(5)
    touched, phases = set(), set()
    for _ in range(8):
        touched.update(feed([grown, reference], rng, 30).tolist())
        phases.add(grown.index.growing)
    assert grown.capacity < reference.capacity and phases == {True, False}
    assert grown.in_reserved_space and grown.values.shape[0] == grown.capacity
    ids = np.array(sorted(touched), np.int64)
    np.testing.assert_array_equal(grown.read(ids), reference.read(ids))
    ours, theirs = saved_rows(grown), saved_rows(reference)
    assert ours.keys() == theirs.keys() == {"ids", "values", "sum"}
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])
    fresh = np.array([10**9], np.int64)  # a new row starts from the optimizer's initial state
    grown.read(fresh)
    assert (grown.state["sum"][grown.rows(fresh)[0]] == 0.25).all()


def test_eviction_mid_growth_keeps_the_rows_it_should_and_new_rows_start_fresh(small_growth):
    grown, reference = grown_and_reference({"ttl_steps": 3})
    rng = np.random.default_rng(6)
    feed([grown, reference], rng, 25)
    while not grown.index.growing:
        feed([grown, reference], rng, 1)
    assert grown.evict() == reference.evict() > 0
    recent = feed([grown, reference], rng, 2)
    np.testing.assert_array_equal(grown.read(recent), reference.read(recent))
    ours, theirs = saved_rows(grown), saved_rows(reference)
    for name in ("ids", "values", "sum", "seen", "last_seen"):
        np.testing.assert_array_equal(ours[name], theirs[name])
    for t in (grown, reference):  # evicted ids come back as fresh rows, in rows an eviction freed
        back = np.setdiff1d(np.arange(6000, dtype=np.int64), t.row_ids[: t.size])[:50]
        rows = t.rows(back)
        assert (t.state["sum"][rows] == 0.25).all() and (t.seen[rows] == 0).all()


def test_tables_grow_by_copying_where_address_space_cannot_be_reserved(small_growth, monkeypatch):
    from paramserver.tables import reserved

    monkeypatch.setattr(reserved, "reserve", lambda rows, row_shape, dtype, huge=False: None)
    grown, reference = grown_and_reference()
    ids = feed([grown, reference], np.random.default_rng(7), 60)
    assert not grown.in_reserved_space and grown.values.shape[0] == grown.capacity < reference.capacity
    np.testing.assert_array_equal(grown.read(ids), reference.read(ids))
    np.testing.assert_array_equal(saved_rows(grown)["sum"], saved_rows(reference)["sum"])


def test_saved_rows_load_into_a_growing_table(small_growth):
    grown, reference = grown_and_reference()
    ids = feed([reference], np.random.default_rng(8), 40)
    saved = saved_rows(reference)
    for lo in range(0, ids.size, 97):
        grown.load_rows(saved["ids"][lo : lo + 97], {k: v[lo : lo + 97] for k, v in saved.items() if k != "ids"})
    np.testing.assert_array_equal(grown.read(ids), reference.read(ids))
    np.testing.assert_array_equal(saved_rows(grown)["sum"], saved["sum"])
