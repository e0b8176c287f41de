"""Tables bigger than memory: a TieredTable under a budget small enough to spill trains, evicts,
saves and loads exactly as an in-memory EmbeddingTable does."""

import numpy as np
import pytest

from paramserver.base.errors import InvalidArgumentError, ResourceExhaustedError
from paramserver.checkpoint.files import shard_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointStore, checkpoint_name
from paramserver.server.shard import Shard
from paramserver.server.shard_metrics import ShardCollector
from paramserver.tables.embedding_table import EmbeddingTable, RowPolicy
from paramserver.tables.limits import TableLimits
from paramserver.tables.sparse_optimizers import build_sparse_optimizer
from paramserver.tables.table_store import TableStore
from paramserver.tables.tiered.spill_space import SpillSpace, remove_stale
from paramserver.tables.tiered.tiers import Tiers

BUDGET = 128 << 10  # a few hundred to a thousand rows of dim 8 in memory
INIT = {"kind": "normal", "std": 0.1}
OPTIMIZERS = {
    "sgd": {"name": "sgd", "hyper": {"lr": 0.5}},
    "adagrad": {"name": "adagrad", "hyper": {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.1}},
    "adam": {"name": "adam", "hyper": {"lr": 0.01}},
    "adam_per_row_step": {"name": "adam", "hyper": {"lr": 0.01, "per_row_step": True}},
    "ftrl": {"name": "ftrl", "hyper": {"lr": 0.05, "l1": 0.001}},
}


@pytest.fixture
def tiers(tmp_path):
    tiers = Tiers.create(BUDGET, str(tmp_path / "spill"), 0)
    yield tiers
    tiers.close()


def pair(tiers, spec, policy=None, dim=8):
    """An in-memory table and a tiered one, alike."""
    policy = policy or RowPolicy()
    memory = EmbeddingTable("t", dim, build_sparse_optimizer(spec), INIT, spec, policy=policy)
    tiered = tiers.new_table("t", dim, build_sparse_optimizer(spec), INIT, spec, policy)
    return memory, tiered


def train(tables, steps, vocab=4000, seed=0):
    """Random lookups (with repeats) and pushes (distinct ids, some never looked up) on every table alike."""
    rng = np.random.default_rng(seed)
    dim = tables[0].dim
    for _ in range(steps):
        looked_up = rng.integers(-vocab // 2, vocab // 2, 200) * 7919  # negative ids too
        rows = [table.read(looked_up) for table in tables]
        for other in rows[1:]:
            np.testing.assert_array_equal(other, rows[0])
        pushed = np.unique(np.concatenate([looked_up[:150], rng.integers(-vocab // 2, vocab // 2, 30) * 7919]))
        grads = rng.standard_normal((pushed.shape[0], dim)).astype(np.float32)
        for table in tables:
            table.apply(pushed, grads)


def saved(table, chunk_rows=512):
    """Every array of row_chunks, rows sorted by id; checks the chunks' positions."""
    chunks, expected_first = [], 0
    for first, arrays in table.row_chunks(chunk_rows):
        rows = arrays["ids"].shape[0]
        assert first == expected_first and (rows == chunk_rows or 0 < rows and first + rows == table.size)
        assert set(arrays) == set(table.layout())
        expected_first += arrays["ids"].shape[0]
        chunks.append({name: np.array(array) for name, array in arrays.items()})
    assert expected_first == table.size
    joined = {name: np.concatenate([c[name] for c in chunks]) for name in table.layout()}
    order = np.argsort(joined["ids"])
    return {name: array[order] for name, array in joined.items()}


def assert_alike(memory, tiered):
    assert tiered.layout() == memory.layout()
    assert (tiered.size, tiered.steps, tiered.counters) == (memory.size, memory.steps, memory.counters)
    ours, theirs = saved(tiered), saved(memory)
    for name in memory.layout():
        assert ours[name].dtype == theirs[name].dtype
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def assert_spilled(tiered):
    described = tiered.describe()
    assert described["disk_rows"] > 0 and described["memory_rows"] < described["rows"]
    assert described["disk_reads"] > 0 and described["disk_writes"] > 0


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_tiered_table_trains_bit_for_bit_as_an_in_memory_one(tiers, optimizer, both_kernel_paths):
    memory, tiered = pair(tiers, OPTIMIZERS[optimizer])
    # the numpy kernels are slower: half the steps, in which every row still goes to disk
    # and is read back several times (asserted), as in the C run's 200
    train([memory, tiered], steps=200 if both_kernel_paths == "c" else 100)
    assert_spilled(tiered)
    assert tiered.describe()["disk_reads"] > 2 * tiered.size  # rows read back from disk twice or more, on average
    assert_alike(memory, tiered)
    every = np.unique(saved(memory)["ids"])
    np.testing.assert_array_equal(tiered.read(every), memory.read(every))


@pytest.mark.parametrize(
    "policy",
    [
        {"ttl_steps": 30, "evict_every": 10},
        {"min_count": 3, "evict_every": 25},
        {"max_rows": 1500, "evict_every": 7},
        {"admit_after": 2, "ttl_steps": 50, "evict_every": 20},
        {"admit_probability": 0.3, "max_rows": 800, "min_count": 2, "evict_every": 15},
    ],
    ids=lambda p: ",".join(p),
)
def test_admission_and_eviction_rules_act_on_a_tiered_table_as_in_memory(tiers, policy):
    memory, tiered = pair(tiers, OPTIMIZERS["adagrad"], RowPolicy(**policy))
    train([memory, tiered], steps=150)
    assert memory.counters["evicted"] + memory.counters["not_admitted_lookups"] > 0
    assert_spilled(tiered)
    assert_alike(memory, tiered)
    assert tiered.evict() == memory.evict()  # an explicit pass too
    assert_alike(memory, tiered)
    train([memory, tiered], steps=20, seed=1)  # evicted rows stay gone on disk: they come back fresh
    assert_alike(memory, tiered)


def test_a_row_admitted_after_an_eviction_starts_unseen_in_memory_too():
    # EmbeddingTable's compaction left the evicted rows' counts behind, for new rows to inherit
    spec = OPTIMIZERS["sgd"]
    table = EmbeddingTable("t", 2, build_sparse_optimizer(spec), INIT, spec, policy=RowPolicy(min_count=3))
    for _ in range(5):
        table.read(np.arange(10, dtype=np.int64))
    table.read(np.arange(10, 20, dtype=np.int64))
    assert table.evict() == 10  # ids 10..19, seen once
    table.read(np.arange(20, 30, dtype=np.int64))  # in the places 10..19 had
    assert saved(table)["seen"].tolist() == [5] * 10 + [1] * 10


def test_saved_rows_load_back_beyond_the_budget_and_train_on_alike(tiers):
    spec = OPTIMIZERS["adam_per_row_step"]
    trained = EmbeddingTable("t", 8, build_sparse_optimizer(spec), INIT, spec, policy=RowPolicy(ttl_steps=1000))
    train([trained], steps=100)
    restored, tiered = pair(tiers, spec, RowPolicy(ttl_steps=1000))
    for table in (restored, tiered):  # a restore: chunk by chunk, then the counters
        for _, arrays in trained.row_chunks(700):
            table.load_rows(arrays["ids"], {name: a for name, a in arrays.items() if name != "ids"})
        table.restore_meta(trained.counters, trained.steps)
    assert tiered.describe()["disk_rows"] > 0
    assert_alike(restored, tiered)
    train([restored, tiered], steps=50, seed=2)
    assert_alike(restored, tiered)


def test_loading_an_id_held_in_memory_or_on_disk_is_refused(tiers):
    _, tiered = pair(tiers, OPTIMIZERS["sgd"])
    ids = np.arange(3000, dtype=np.int64)
    tiered.load_rows(ids, {"values": np.ones((3000, 8), np.float32)})
    assert tiered.describe()["memory_rows"] < 3000 < tiered.size + 1
    for again in (ids[:1], ids[-1:], np.array([5000, 5000])):  # in memory, on disk, twice in one chunk
        with pytest.raises(InvalidArgumentError, match="twice"):
            tiered.load_rows(again, {"values": np.ones((again.shape[0], 8), np.float32)})
    assert tiered.size == 3000


def test_a_checkpoint_moves_a_table_between_memory_and_tiers_and_back(tmp_path):
    def trained_store(**tiered):
        store = TableStore(0, **tiered)
        store.register("t", 4, OPTIMIZERS["adam_per_row_step"], INIT, policy={"ttl_steps": 500})
        return store

    def checkpoint(tables, step):
        files = CheckpointStore(str(tmp_path / "ckpt"))
        name = checkpoint_name(step)
        written = shard_file.write(files, name, Shard(0), tables)
        files.commit(name, {"step": step, "num_shards": 1, "shards": [written.__dict__]})
        return RestoreSource(files, name)

    memory = trained_store()
    train([memory.table("t")], steps=60)
    tiered = trained_store(restore=checkpoint(memory, 10), tiers=Tiers.create(1 << 16, str(tmp_path / "spill"), 0))
    assert tiered.describe()["t"]["disk_rows"] > 0
    assert_alike(memory.table("t"), tiered.table("t"))
    train([memory.table("t"), tiered.table("t")], steps=20, seed=3)
    back = trained_store(restore=checkpoint(tiered, 20))
    assert_alike(memory.table("t"), back.table("t"))
    tiered.close()


def test_a_failing_disk_fails_the_request_and_keeps_the_rows_in_memory(tiers):
    memory, tiered = pair(tiers, OPTIMIZERS["adagrad"])
    train([memory, tiered], steps=30)
    db = tiered.store.db

    class FullDisk:
        def __getattr__(self, name):
            return getattr(db, name)

        def write(self, *args):
            raise Exception("IO error: No space left on device")

    tiered.store.db = FullDisk()
    with pytest.raises(ResourceExhaustedError, match="spill store .*: cannot write rows: .*No space left"):
        tiered.read(np.arange(10_000, 13_000, dtype=np.int64))  # new rows: memory must make room
    tiered.store.db = db
    every = saved(memory)["ids"]
    np.testing.assert_array_equal(tiered.read(every), memory.read(every))  # nothing trained was lost


def test_tables_share_the_budget_and_count_their_memory_tier_in_the_limits(tmp_path):
    limits = TableLimits(max_rows=100, max_bytes=BUDGET, max_tiered_rows=5000)
    store = TableStore(0, limits=limits, tiers=Tiers.create(BUDGET, str(tmp_path), 0))
    store.register("a", 8, OPTIMIZERS["adagrad"], INIT)
    alone = store.describe()["a"]["memory_capacity"]
    store.lookup("a", np.arange(2000, dtype=np.int64))  # past max_table_rows, within max_tiered_table_rows
    before = store.lookup("a", np.arange(2000, dtype=np.int64))
    store.register("b", 16, OPTIMIZERS["sgd"], INIT)
    described = store.describe()
    assert described["a"]["memory_capacity"] < alone and described["a"]["rows"] == 2000
    assert store.held_bytes() <= BUDGET
    assert sum(d["bytes"] for d in described.values()) <= BUDGET
    np.testing.assert_array_equal(store.lookup("a", np.arange(2000, dtype=np.int64)), before)
    with pytest.raises(ResourceExhaustedError, match="max_tiered_table_rows"):
        store.lookup("a", np.arange(2000, 5001, dtype=np.int64))
    assert store.describe()["a"]["rows"] == 2000  # nothing created
    store.close()
    assert list(tmp_path.iterdir()) == []  # the PS's spill directory went with it


def test_a_tiered_table_figures_in_the_shard_metrics(tmp_path):
    store = TableStore(0, tiers=Tiers.create(BUDGET, str(tmp_path), 0))
    store.register("t", 8, OPTIMIZERS["sgd"], INIT)
    store.lookup("t", np.arange(5000, dtype=np.int64))
    found = {
        (sample.name, sample.labels["table"]): sample.value
        for family in ShardCollector(Shard(0, tables=store), store).collect()
        for sample in family.samples
        if "table" in sample.labels
    }
    described = store.describe()["t"]
    assert found[("paramserver_table_rows", "t")] == 5000
    assert found[("paramserver_table_memory_rows", "t")] == described["memory_rows"] < 5000
    assert found[("paramserver_table_disk_rows", "t")] == described["disk_rows"] > 0
    assert found[("paramserver_table_disk_writes_total", "t")] == described["disk_writes"] > 0
    store.close()


def died(space):
    """What a killed PS leaves: its marked subdirectory, its lock free (the process is gone)."""
    space.abandon()
    return space.path


def test_a_ps_removes_only_its_own_stale_spill_directories(tmp_path):
    dead = died(SpillSpace.create(str(tmp_path), 0))
    (dead / "rows.sst").write_bytes(b"x" * 100)
    for name in ("shard-0-foreign", "shard-1-other", ".shard-0-half", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "shard-0-foreign" / "LOCK").touch()  # no marker: not made by a PS
    (tmp_path / ".shard-0-half" / "LOCK").touch()
    live = SpillSpace.create(str(tmp_path), 0)  # deletes the dead one; then a live PS holds its own
    assert not dead.exists()
    try:
        space = SpillSpace.create(str(tmp_path), 0)
        left = sorted(p.name for p in tmp_path.iterdir())
        expected = ["shard-0-foreign", "shard-1-other", ".shard-0-half", "notes", live.path.name, space.path.name]
        assert left == sorted(expected)
        assert space.path.name.startswith("shard-0-")
        assert remove_stale(tmp_path, 0) == []  # its own is locked while it lives
        assert space.close() and not space.path.exists()
    finally:
        died(live)
    assert [p.name for p in remove_stale(tmp_path, 0)] == [live.path.name]  # its PS is gone now
    assert (tmp_path / "shard-0-foreign" / "LOCK").exists()


def test_the_memory_tier_drops_rows_by_moving_its_last_rows_into_their_places(both_kernel_paths):
    from paramserver.tables.row_record import RowRecord
    from paramserver.tables.tiered.hot_rows import HotRows

    record = RowRecord(4, build_sparse_optimizer(OPTIMIZERS["adagrad"]), tracks_use=False)
    hot = HotRows(record, 1000)
    rng = np.random.default_rng(5)
    ids = rng.permutation(np.arange(-500, 500, dtype=np.int64) * 7919)
    records = record.from_arrays(1000, {"values": rng.standard_normal((1000, 4)).astype(np.float32)})
    hot.add(ids, records, clock=1, on_disk=False)
    expected = dict(zip(ids.tolist(), records["values"]))
    for _ in range(5):
        dropped = rng.choice(hot.size, 120, replace=False)
        for key in hot.ids[dropped].tolist():
            del expected[key]
        hot.remove(dropped)
        assert hot.size == len(expected)
        kept = np.array(list(expected), np.int64)
        rows = hot.find(kept)
        assert (rows >= 0).all() and (rows < hot.size).all()  # rows stay 0..size-1
        np.testing.assert_array_equal(hot.values[rows], np.array([expected[k] for k in kept.tolist()]))
        np.testing.assert_array_equal(hot.ids[rows], kept)


@pytest.mark.parametrize("spread", [50, 10**9])  # counted per touch time, or partitioned
def test_the_memory_tier_picks_its_least_recently_touched_rows_to_drop(spread):
    from paramserver.tables.row_record import RowRecord
    from paramserver.tables.tiered.hot_rows import HotRows

    hot = HotRows(RowRecord(4, build_sparse_optimizer(OPTIMIZERS["sgd"]), tracks_use=False), 1000)
    rng = np.random.default_rng(6)
    hot.add(np.arange(1000, dtype=np.int64), hot.record.empty(1000), clock=0, on_disk=False)
    clock = spread
    hot.touched[:] = rng.integers(0, clock + 1, 1000)
    for count in (0, 1, 300, 999, 2000):
        picked = hot.least_recent(count, clock)
        idle = np.flatnonzero(hot.touched < clock)
        assert picked.shape[0] == min(count, idle.shape[0]) == np.unique(picked).shape[0]
        assert (hot.touched[picked] < clock).all()
        rest = np.setdiff1d(idle, picked)
        if picked.shape[0] and rest.shape[0]:
            assert hot.touched[picked].max() <= hot.touched[rest].min()
