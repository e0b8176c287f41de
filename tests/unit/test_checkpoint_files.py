"""Checkpoint files without a cluster: the manifest as the commit, damaged files named, restore
onto other shard counts, and models that do not fit."""

import json

import numpy as np
import pytest

from paramserver.base.hashing import shard_of
from paramserver.checkpoint import shard_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointError, CheckpointStore, checkpoint_name
from paramserver.client.placement import Placer
from paramserver.server.shard import Push, Shard
from paramserver.server.table_store import TableStore

SGD = {"name": "sgd", "hyper": {"lr": 0.1, "momentum": 0.9}}
ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
VALUES = {"w": np.arange(40, dtype=np.float32).reshape(10, 4), "b": np.ones(3, np.float32)}
IDS = np.arange(100, dtype=np.int64) * 7919


def cluster(num_shards, restore=None):
    """Shards holding VALUES placed as a client would (w split across shards) and a table."""
    placer = Placer(num_shards, split_bytes=64)
    shards = [Shard(i, restore=restore) for i in range(num_shards)]
    tables = [TableStore(i, restore=restore) for i in range(num_shards)]
    parts = {}
    for var, value in VALUES.items():
        for part in placer.place(var, value.shape, 4):
            parts.setdefault(part.shard, {})[part.name] = value if part.whole else value[part.lo:part.hi]
    for shard, held in parts.items():
        shards[shard].register("g", SGD, {name: np.ascontiguousarray(v) for name, v in held.items()})
    for store in tables:
        store.register("t", 2, ADAGRAD, {"kind": "zeros"}, num_shards=num_shards)
    return shards, tables, parts


def train(shards, tables, parts, steps=3):
    for _ in range(steps):
        for shard, held in parts.items():
            shards[shard].push(Push({name: np.full(v.shape, 0.5, np.float32) for name, v in held.items()}))
        owner = shard_of(IDS, len(tables))
        for i, store in enumerate(tables):
            mine = IDS[owner == i]
            store.lookup("t", mine)
            store.push("t", mine, np.full((mine.shape[0], 2), 0.25, np.float32))


def save(tmp_path, shards, tables, step=10):
    store = CheckpointStore(str(tmp_path))
    name = checkpoint_name(step)
    entries = [shard_file.write(store, name, s, t).__dict__ for s, t in zip(shards, tables)]
    store.commit(name, {"step": step, "num_shards": len(shards), "shards": entries})
    return store, name


def read_all(shards, tables, parts):
    dense = {}
    for shard, held in parts.items():
        shards[shard].pull(list(held), lambda version, views: dense.update({n: v.copy() for n, v in views}))
    owner = shard_of(IDS, len(tables))
    rows = np.zeros((IDS.shape[0], 2), np.float32)
    for i, store in enumerate(tables):
        rows[owner == i] = store.lookup("t", IDS[owner == i])
    return dense, rows


def whole(dense):
    w = np.concatenate([dense[k] for k in sorted((k for k in dense if k.startswith("w")),
                                                 key=lambda k: int(k[2:].split(":")[0]) if "[" in k else 0)])
    return w, dense["b"]


@pytest.mark.parametrize("written_by, restored_on", [(2, 3), (3, 1), (1, 2)])
def test_restore_onto_another_number_of_shards_keeps_values_state_and_rows(tmp_path, written_by, restored_on):
    shards, tables, parts = cluster(written_by)
    train(shards, tables, parts)
    store, name = save(tmp_path, shards, tables)
    before_dense, before_rows = read_all(shards, tables, parts)
    source = RestoreSource(store, name)
    new_shards, new_tables, new_parts = cluster(restored_on, source)
    after_dense, after_rows = read_all(new_shards, new_tables, new_parts)
    for a, b in zip(whole(before_dense), whole(after_dense)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(before_rows, after_rows)
    # optimizer state came back too: one more identical step lands on the same values on both
    train(shards, tables, parts, steps=1)
    train(new_shards, new_tables, new_parts, steps=1)
    for a, b in zip(whole(read_all(shards, tables, parts)[0]), whole(read_all(new_shards, new_tables, new_parts)[0])):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    np.testing.assert_allclose(read_all(shards, tables, parts)[1], read_all(new_shards, new_tables, new_parts)[1],
                               rtol=1e-6)


def damaged(tmp_path):
    shards, tables, parts = cluster(2)
    store, first = save(tmp_path, shards, tables, step=10)
    train(shards, tables, parts)
    save(tmp_path, shards, tables, step=20)
    return store, tmp_path / "ckpt-000000020"


@pytest.mark.parametrize("damage, fragment", [
    (lambda d: (d / "shard-1.safetensors").write_bytes((d / "shard-1.safetensors").read_bytes()[:-10]), "truncated"),
    (lambda d: (d / "shard-0.safetensors").unlink(), "shard-0.safetensors named by the manifest is missing"),
    (lambda d: (d / "shard-1.safetensors").write_bytes(b"x" + (d / "shard-1.safetensors").read_bytes()[1:]),
     "SHA-256"),
    (lambda d: (d / "MANIFEST.json").write_text("{not json"), "not valid JSON"),
])
def test_a_damaged_checkpoint_is_a_clear_error_and_resume_takes_the_one_before(tmp_path, damage, fragment):
    store, latest = damaged(tmp_path)
    damage(latest)
    with pytest.raises(CheckpointError, match=fragment):
        RestoreSource(store, "ckpt-000000020")
    assert RestoreSource.latest(store).name == "ckpt-000000010"


def test_a_checkpoint_without_its_manifest_does_not_exist(tmp_path):
    store, latest = damaged(tmp_path)
    (latest / "MANIFEST.json").unlink()  # as if the writer died before the commit
    (tmp_path / "ckpt-000000030").mkdir()
    (tmp_path / "ckpt-000000030" / "shard-0.safetensors.tmp-1234").write_bytes(b"partial")
    assert store.complete() == ["ckpt-000000010"]
    assert RestoreSource.latest(store).step == 10


def test_keep_deletes_the_oldest_checkpoints(tmp_path):
    shards, tables, _ = cluster(1)
    for step in (10, 20, 30, 40):
        store, _ = save(tmp_path, shards, tables, step)
    assert store.prune(2) == ["ckpt-000000010", "ckpt-000000020"]
    assert store.complete() == ["ckpt-000000030", "ckpt-000000040"]


def test_names_from_the_wire_cannot_point_outside_the_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint name"):
        CheckpointStore(str(tmp_path)).write_shard("../../etc", 0, b"x")


def test_a_checkpoint_of_another_model_is_refused_naming_what_differs(tmp_path):
    shards, tables, _ = cluster(1)
    store, name = save(tmp_path, shards, tables)
    source = RestoreSource(store, name)
    with pytest.raises(CheckpointError, match="optimizer"):
        Shard(0, restore=source).register("g", ADAGRAD, {k: v.copy() for k, v in VALUES.items()})
    with pytest.raises(CheckpointError, match=r"'w' has shape \(10, 4\) there, not \(10, 5\)"):
        Shard(0, restore=source).register("g", SGD, {"w": np.zeros((10, 5), np.float32), "b": VALUES["b"]})
    with pytest.raises(CheckpointError, match="no variable group 'other'"):
        Shard(0, restore=source).register("other", SGD, {"v": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError, match="table 't' has dim 2"):
        TableStore(0, restore=source).register("t", 3, ADAGRAD, {"kind": "zeros"})
    manifest = json.loads((tmp_path / name / "MANIFEST.json").read_text())
    assert manifest["format"] == "paramserver-checkpoint" and manifest["step"] == 10
