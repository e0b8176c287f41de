"""Incremental checkpoints: a chain (base + deltas) restores exactly what a whole checkpoint at the
same point restores (every saved array of every row, row order and counters, with eviction in
between), onto the same and onto another number of shards; retention keeps a chain whole; a
damaged delta falls back to the newest good point of its chain."""
import logging
import os

import numpy as np
import pytest
from tests.unit.test_checkpointer import Begun

from paramserver.base.hashing import shard_of
from paramserver.checkpoint.files import shard_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.shard_writes import ShardWrites
from paramserver.checkpoint.store import CheckpointError, CheckpointStore, checkpoint_name
from paramserver.server.shard import Shard
from paramserver.tables.table_store import TableStore

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
POLICY = {"ttl_steps": 3, "evict_every": 2}  # rows not looked up for 3 updates go, every 2nd update
INIT = {"kind": "normal", "std": 0.1}


class Cluster:
    """`num_ps` shards of table t, each writing its incremental files (ShardWrites) into `chain`
    and, at the same points, whole files into `whole`."""

    def __init__(self, tmp_path, num_ps=1, seed=0, policy=POLICY, chain_url=None):
        self.num_ps = num_ps
        self.shards = []
        for index in range(num_ps):
            tables = TableStore(index)
            tables.register("t", 4, ADAGRAD, INIT, policy=policy, num_shards=num_ps)
            self.shards.append(Shard(index, tables=tables))
        self.writes = [ShardWrites(chain_url or str(tmp_path / "chain")) for _ in range(num_ps)]
        self.chain = self.writes[0].store
        self.whole = CheckpointStore(str(tmp_path / "whole"))
        self.rng = np.random.default_rng(seed)
        self.parent = ""

    def train(self, steps, universe=400, batch=40):
        for _ in range(steps):
            ids = self.rng.choice(universe, batch, replace=False).astype(np.int64)
            for index, shard in enumerate(self.shards):
                mine = ids[shard_of(ids, self.num_ps) == index]
                shard.tables.lookup("t", mine)
                grads = self.rng.normal(size=(mine.shape[0], 4)).astype(np.float32)
                shard.tables.push_checked([shard.tables.check_push("t", mine, grads)])

    def checkpoint(self, step, delta=True):
        """Checkpoint `step` both ways; returns the chain's entries."""
        name = checkpoint_name(step)
        entries = [w(name, s, parent=self.parent if delta else "") for w, s in zip(self.writes, self.shards)]
        self.chain.commit(name, {"step": step, "num_shards": self.num_ps, "shards": entries})
        whole = [shard_file.write(self.whole, name, s, s.tables).__dict__ for s in self.shards]
        self.whole.commit(name, {"step": step, "num_shards": self.num_ps, "shards": whole})
        self.parent = name
        return entries


def test_a_shard_that_lost_its_snapshots_writes_a_whole_file_and_the_checkpoint_restores_exactly(tmp_path):
    cluster = Cluster(tmp_path, num_ps=2)
    for step in range(1, 5):
        cluster.train(3)
        if step == 3:  # shard 1 restarted its writer: it has no snapshot of checkpoint 2
            cluster.writes[1] = ShardWrites(cluster.chain.url)
        entries = cluster.checkpoint(step, delta=step > 1)
        if step == 3:
            assert entries[0]["parent"] == checkpoint_name(2) and "parent" not in entries[1]
    for name in (checkpoint_name(3), checkpoint_name(4)):
        assert_same(restored(cluster.chain, name, 2), restored(cluster.whole, name, 2))
        assert_same(restored(cluster.chain, name, 3), restored(cluster.whole, name, 3))


def restored(store, name, num_ps):
    """Every shard's table t restored from checkpoint `name` onto `num_ps` shards: its arrays."""
    source = RestoreSource(store, name)
    out = []
    for index in range(num_ps):
        tables = TableStore(index, restore=source)
        tables.register("t", 4, ADAGRAD, INIT, policy=POLICY, num_shards=num_ps)
        table = tables.table("t")
        arrays = {key: table.array(key)[: table.size].copy() for key in table.layout()}
        out.append((arrays, dict(table.counters), table.steps))
    return out


def assert_same(chain, whole):
    assert len(chain) == len(whole)
    for (arrays, counters, steps), (expected, expected_counters, expected_steps) in zip(chain, whole):
        assert (counters, steps) == (expected_counters, expected_steps)
        assert arrays.keys() == expected.keys()
        for key in expected:  # bit for bit, in row order
            assert arrays[key].dtype == expected[key].dtype
            assert arrays[key].tobytes() == expected[key].tobytes(), key


@pytest.mark.parametrize("policy", [POLICY, {"max_rows": 150, "evict_every": 2}, {"min_count": 2, "evict_every": 3}],
                         ids=["ttl", "max-rows", "min-count"])
def test_a_chain_restores_what_a_whole_checkpoint_restores_at_every_point(tmp_path, policy):
    cluster = Cluster(tmp_path, policy=policy)
    names = []
    for step in range(1, 9):
        cluster.train(3)
        entries = cluster.checkpoint(step, delta=step > 1)
        assert bool(entries[0].get("parent")) == (step > 1)
        names.append(checkpoint_name(step))
    table = cluster.shards[0].tables.table("t")
    assert table.counters["evicted"] > 0  # rows were evicted between the checkpoints
    for name in names:
        assert_same(restored(cluster.chain, name, 1), restored(cluster.whole, name, 1))
    cluster.checkpoint(9)  # nothing changed since 8: a delta of no rows
    delta = RestoreSource(cluster.chain, checkpoint_name(9)).shard_file(0).tensors
    assert delta["table/t/ids"].shape == (0,) and delta["table/t/deleted"].shape == (0,)
    assert_same(restored(cluster.chain, checkpoint_name(9), 1), restored(cluster.whole, checkpoint_name(9), 1))


def test_evicted_rows_stay_deleted_and_a_deleted_id_may_come_back(tmp_path):
    cluster = Cluster(tmp_path)
    cluster.train(2, universe=100)
    cluster.checkpoint(1, delta=False)
    table = cluster.shards[0].tables.table("t")
    before = set(table.row_ids[: table.size].tolist())
    cluster.train(4, universe=50)  # ids 50..99 are not looked up again: evicted
    cluster.checkpoint(2)
    gone = before - set(table.row_ids[: table.size].tolist())
    assert gone
    deleted = RestoreSource(cluster.chain, checkpoint_name(2)).shard_file(0)
    assert deleted.tensors["table/t/deleted"].shape[0] >= len(gone)
    (arrays, _, _), = restored(cluster.chain, checkpoint_name(2), 1)
    assert not gone & set(arrays["ids"].tolist())
    cluster.train(2, universe=100)  # some come back, as new rows
    cluster.checkpoint(3)
    assert_same(restored(cluster.chain, checkpoint_name(3), 1), restored(cluster.whole, checkpoint_name(3), 1))


def test_a_chain_of_two_shards_restores_onto_three(tmp_path):
    cluster = Cluster(tmp_path, num_ps=2)
    for step in range(1, 5):
        cluster.train(3)
        cluster.checkpoint(step, delta=step > 1)
    name = checkpoint_name(4)
    assert_same(restored(cluster.chain, name, 3), restored(cluster.whole, name, 3))
    assert_same(restored(cluster.chain, name, 2), restored(cluster.whole, name, 2))


def test_readers_without_a_table_see_the_rows_current_at_the_checkpoint(tmp_path):
    cluster = Cluster(tmp_path)
    for step in range(1, 5):
        cluster.train(3)
        cluster.checkpoint(step, delta=step > 1)
    name = checkpoint_name(4)
    chain, whole = RestoreSource(cluster.chain, name), RestoreSource(cluster.whole, name)
    assert chain.links == [checkpoint_name(step) for step in range(1, 5)]
    assert chain.tables["t"]["rows"] == whole.tables["t"]["rows"]
    (got_ids, got), (expected_ids, expected) = current_rows(chain, "t"), current_rows(whole, "t")
    order, expected_order = np.argsort(got_ids), np.argsort(expected_ids)
    assert got_ids[order].tobytes() == expected_ids[expected_order].tobytes()
    assert got[order].tobytes() == expected[expected_order].tobytes()


def current_rows(source: RestoreSource, table: str) -> tuple[np.ndarray, np.ndarray]:
    """Every row of `table` current at `source`'s checkpoint, as a reader without a table streams them."""
    slices = [taken for index in source.table_files(table) for taken in source.table_slices(table, index, ["values"])]
    return np.concatenate([ids for ids, _ in slices]), np.concatenate([arrays["values"] for _, arrays in slices])


def test_a_tiered_shard_writes_whole_files_when_asked_for_a_delta(tmp_path):
    from paramserver.tables.tiered.tiers import Tiers

    tiers = Tiers.create(1 << 20, str(tmp_path / "spill"), 0)
    tables = TableStore(0, tiers=tiers)
    tables.register("t", 4, ADAGRAD, INIT)
    shard = Shard(0, tables=tables)
    writes = ShardWrites(str(tmp_path / "chain"))
    tables.lookup("t", np.arange(10, dtype=np.int64))
    first = writes(checkpoint_name(1), shard)
    writes.store.commit(checkpoint_name(1), {"step": 1, "num_shards": 1, "shards": [first]})
    second = writes(checkpoint_name(2), shard, parent=checkpoint_name(1))
    assert "parent" not in second
    tiers.close()


def test_retention_keeps_the_base_and_deltas_a_kept_checkpoint_needs(tmp_path):
    cluster = Cluster(tmp_path)
    for step in range(1, 7):
        cluster.train(1)
        cluster.checkpoint(step, delta=step not in (1, 5))  # bases at 1 and 5
    removed = cluster.chain.prune(keep=2)  # keeps 5 and 6 (a base and its delta): 1..4 go
    assert removed == [checkpoint_name(step) for step in range(1, 5)]
    assert cluster.chain.complete() == [checkpoint_name(5), checkpoint_name(6)]
    cluster.train(1)
    cluster.checkpoint(7)
    cluster.train(1)
    cluster.checkpoint(8)
    assert cluster.chain.prune(keep=1) == []  # 8 needs 7, 6 and its base 5
    assert_same(restored(cluster.chain, checkpoint_name(8), 1), restored(cluster.whole, checkpoint_name(8), 1))


def test_a_damaged_delta_falls_back_to_the_last_good_point_of_the_chain(tmp_path, caplog):
    cluster = Cluster(tmp_path)
    for step in range(1, 6):
        cluster.train(2)
        cluster.checkpoint(step, delta=step > 1)
    path = os.path.join(cluster.chain.root, checkpoint_name(4), "shard-0.safetensors")
    with open(path, "r+b") as handle:  # flip a byte of a row
        handle.seek(os.path.getsize(path) - 3)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with caplog.at_level(logging.WARNING, logger="paramserver.checkpoint.restore"):
        source = RestoreSource.latest(cluster.chain)
    assert source.name == checkpoint_name(3)  # 5 and 4 need the damaged delta
    assert "cannot resume from ckpt-000000005" in caplog.text and "ckpt-000000004" in caplog.text
    with pytest.raises(CheckpointError, match="ckpt-000000004"):
        RestoreSource(cluster.chain, checkpoint_name(5))
    assert cluster.chain.prune(keep=1) == []  # 5 does not count (its chain is damaged): 3 and its chain stay


def test_a_missing_base_makes_the_chain_unusable(tmp_path):
    cluster = Cluster(tmp_path)
    for step in range(1, 4):
        cluster.train(2)
        cluster.checkpoint(step, delta=step > 1)
    cluster.chain.fs.rm(cluster.chain.path(checkpoint_name(1)), recursive=True)
    with pytest.raises(CheckpointError, match="ckpt-000000001"):
        RestoreSource(cluster.chain, checkpoint_name(3))
    assert RestoreSource.latest(cluster.chain) is None


class ChainClient:
    """The chief's view of a Cluster: its Checkpoint calls go to the shards' ShardWrites."""

    channels = [object()]
    incarnations = [None]
    consistency = type("Spec", (), {"to_dict": lambda self: {"mode": "async"}})()

    def __init__(self, cluster):
        self.cluster = cluster
        self.asked = []  # the parent each checkpoint was asked on

    def begin_checkpoint(self, name, timeout, parent=""):
        return Begun(self.checkpoint(name, timeout, parent))

    def checkpoint(self, name, timeout, parent=""):
        self.asked.append(parent)
        return [w(name, s, parent=parent) for w, s in zip(self.cluster.writes, self.cluster.shards)]

    def shard_stats(self):
        return None


def test_the_chief_writes_a_base_every_k_checkpoints_and_deltas_between(tmp_path):
    from paramserver.worker.recovery.checkpoints import Checkpointer

    cluster = Cluster(tmp_path, policy={})
    cluster.train(1, universe=3000, batch=2000)
    client = ChainClient(cluster)
    chief = Checkpointer(client, cluster.chain, 0, 2, 0, lambda name, timeout: None, report=lambda values: None,
                         base_every=3)
    for step in range(1, 8):
        cluster.train(1, batch=5)
        chief.save(step, 10.0, counters=[])
    names = [checkpoint_name(step) for step in range(1, 8)]
    assert client.asked == ["", names[0], names[1], "", names[3], names[4], ""]
    manifest = cluster.chain.manifest(names[5])
    assert (manifest["parent"], manifest["base"]) == (names[4], names[3])
    # keep=2 keeps 6 and 7 (a base) and what 6 needs: 4 and 5
    assert cluster.chain.complete() == names[3:]


def test_a_chain_past_its_share_of_the_base_starts_a_new_base(tmp_path):
    from paramserver.worker.recovery.checkpoints import Checkpointer

    cluster = Cluster(tmp_path)
    client = ChainClient(cluster)
    chief = Checkpointer(client, cluster.chain, 0, 5, 0, lambda name, timeout: None, report=lambda values: None,
                         base_every=100)
    for step in range(1, 6):
        cluster.train(3, universe=200, batch=150)  # most rows change: each delta is most of a base
        chief.save(step, 10.0, counters=[])
    assert client.asked[:3] == ["", checkpoint_name(1), ""]


def test_list_inspect_and_export_read_chains(tmp_path):
    from safetensors.numpy import load_file

    from paramserver.checkpoint import tools

    cluster = Cluster(tmp_path, num_ps=2)
    for step in range(1, 4):
        cluster.train(3)
        cluster.checkpoint(step, delta=step > 1)
    rows = tools.list_checkpoints(cluster.chain.url)
    assert [(row["kind"], row["status"]) for row in rows] == [("base", "ok"), ("delta", "ok"), ("delta", "ok")]
    assert rows[-1]["chain"] == [checkpoint_name(step) for step in range(1, 4)]
    chain, whole = tools.inspect(cluster.chain.url), tools.inspect(cluster.whole.url)
    assert chain["chain"] == rows[-1]["chain"] and whole["chain"] == [checkpoint_name(3)]
    assert chain["tables"]["t"]["rows"] == whole["tables"]["t"]["rows"]
    exported = [load_file(tools.export(store.url, None, str(tmp_path / f"{kind}.safetensors")))
                for kind, store in (("chain", cluster.chain), ("whole", cluster.whole))]
    (ids, weight), (expected_ids, expected_weight) = [
        (found["embeddings/t/ids"], found["embeddings/t/weight"]) for found in exported]
    order, expected_order = np.argsort(ids), np.argsort(expected_ids)
    assert ids[order].tobytes() == expected_ids[expected_order].tobytes()
    assert weight[order].tobytes() == expected_weight[expected_order].tobytes()


def test_a_tiered_table_restores_the_rows_of_a_chain(tmp_path):
    from paramserver.tables.tiered.tiers import Tiers

    cluster = Cluster(tmp_path)
    for step in range(1, 5):
        cluster.train(3)
        cluster.checkpoint(step, delta=step > 1)

    def rows_by_id(store, where):
        tiers = Tiers.create(1 << 16, str(tmp_path / where), 0)  # a small budget: most rows on disk
        tables = TableStore(0, restore=RestoreSource(store, checkpoint_name(4)), tiers=tiers)
        tables.register("t", 4, ADAGRAD, INIT, policy=POLICY)
        chunks = [arrays for _, arrays in tables.table("t").row_chunks(64)]
        arrays = {key: np.concatenate([chunk[key] for chunk in chunks]) for key in chunks[0]}
        order = np.argsort(arrays["ids"])
        tiers.close()
        return {key: array[order] for key, array in arrays.items()}

    got, expected = rows_by_id(cluster.chain, "a"), rows_by_id(cluster.whole, "b")
    assert got.keys() == expected.keys() and got["ids"].shape[0] > 0
    for key in expected:
        assert got[key].tobytes() == expected[key].tobytes(), key


@pytest.mark.parametrize("meta, manifest, reason", [
    (lambda d: d.update(parent="../ckpt-000000001"), None, "parent: .*not a checkpoint name"),
    # a file made whole: its rows disagree with its ids (or else it disagrees with its manifest entry)
    (lambda d: d.update(parent=None), None, "rows and holds|delta on nothing, its manifest entry says ckpt-000000001"),
    (None, {"parent": "ckpt-000000009"}, "not an earlier checkpoint"),
    # a delta's rows: those its chain makes current (export and serving count them)
    (lambda d: d["tables"]["t"].update(rows=d["tables"]["t"]["rows"] + 1), None, r"says \d+ rows and its chain holds"),
], ids=["parent-a-path", "file-without-parent", "parent-later", "delta-rows"])
def test_a_crafted_delta_is_refused_naming_it(tmp_path, meta, manifest, reason):
    from tests.unit.test_checkpoint_trust import manifest_entry, rewrite

    cluster = Cluster(tmp_path)
    for step in (1, 2):
        cluster.train(2)
        cluster.checkpoint(step, delta=step > 1)
    root = tmp_path / "chain"
    if meta is not None:
        rewrite(root, 0, meta=meta, name=checkpoint_name(2))
    if manifest is not None:
        manifest_entry(root, 0, name=checkpoint_name(2), **manifest)
    if reason is None:
        RestoreSource(cluster.chain, checkpoint_name(2))
        return
    with pytest.raises(CheckpointError, match=reason):
        RestoreSource(CheckpointStore(str(root)), checkpoint_name(2))


def test_a_whole_file_whose_rows_disagree_with_its_ids_is_refused(tmp_path):
    from tests.unit.test_checkpoint_trust import rewrite

    cluster = Cluster(tmp_path)
    cluster.train(2)
    cluster.checkpoint(1, delta=False)
    rewrite(tmp_path / "chain", 0, meta=lambda d: d["tables"]["t"].update(rows=1), name=checkpoint_name(1))
    with pytest.raises(CheckpointError, match="table 't' says 1 rows and holds"):
        RestoreSource(CheckpointStore(str(tmp_path / "chain")), checkpoint_name(1))
