"""Checkpoint files without a cluster: the manifest as the commit, damaged files named, restore
onto other shard counts, and models that do not fit; filesystem failures (a full disk, a
read-only directory, any operation failing) as CheckpointErrors that leave no partial file;
retention that counts verified checkpoints only; `checkpoint list` flagging damaged ones."""

import errno
import json
import os
import re

import numpy as np
import pytest
from tests.unit.checkpoint_faults import Disk, files, read_only

from paramserver.base.hashing import shard_of
from paramserver.checkpoint import tools
from paramserver.checkpoint.files import shard_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointError, CheckpointStore, checkpoint_name
from paramserver.client.placement import Placer
from paramserver.server.shard import Push, Shard
from paramserver.tables.table_store import TableStore

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
            store.apply_rows([[store.check_push("t", mine, np.full((mine.shape[0], 2), 0.25, np.float32))]])


def save(tmp_path, shards, tables, step=10, store=None):
    store = store or CheckpointStore(str(tmp_path))
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


# ---- filesystem failures: CheckpointErrors naming the file and the OS's reason -------------

TMP = r"\.tmp-[0-9a-f]{8}"


def written(tmp_path, steps=(10,)):
    """A store over `tmp_path` with one-shard checkpoints at `steps`; the shard and its tables."""
    shards, tables, _ = cluster(1)
    for step in steps:
        store, _ = save(tmp_path, shards, tables, step)
    return store, shards[0], tables[0]


def temporary(directory) -> list[str]:
    return [name for name in files(directory) if ".tmp-" in name]


def test_a_full_disk_is_a_checkpoint_error_naming_the_file_and_its_partial_file_is_removed(tmp_path):
    shards, tables, _ = cluster(1)
    disk = Disk(space=100)
    store = CheckpointStore(str(tmp_path), fs=disk)
    where = re.escape(f"{tmp_path}/ckpt-000000010/")
    with pytest.raises(CheckpointError, match=rf"^checkpoint ckpt-000000010: cannot write {where}shard-0\.safetensors"
                                              rf"{TMP}: No space left on device \(ENOSPC\)$"):
        shard_file.write(store, "ckpt-000000010", shards[0], tables[0])
    assert [size for _, size in disk.partial] == [100]  # the write had put 100 bytes on disk...
    assert files(tmp_path) == []  # ...and they are gone

    disk.space = None
    entry = shard_file.write(store, "ckpt-000000010", shards[0], tables[0])
    disk.space = 50  # the manifest does not fit
    with pytest.raises(CheckpointError, match=rf"cannot write {where}MANIFEST\.json{TMP}: No space left on device"):
        store.commit("ckpt-000000010", {"step": 10, "num_shards": 1, "shards": [entry.__dict__]})
    assert files(tmp_path) == ["ckpt-000000010/shard-0.safetensors"] and store.complete() == []
    assert store.discard("ckpt-000000010")  # what the chief does with a checkpoint that failed
    assert files(tmp_path) == [] and not (tmp_path / "ckpt-000000010").exists()


@pytest.mark.parametrize("fail, act, says", [
    ({"makedirs": errno.EACCES}, lambda store, shard, tables: shard_file.write(store, "ckpt-000000030", shard, tables),
     r"^checkpoint ckpt-000000030: cannot create directory \S+/ckpt-000000030: Permission denied \(EACCES\)$"),
    ({"write": errno.EIO}, lambda store, shard, tables: shard_file.write(store, "ckpt-000000020", shard, tables),
     rf"^checkpoint ckpt-000000020: cannot write \S+/ckpt-000000020/shard-0\.safetensors{TMP}: "
     r"Input/output error \(EIO\)$"),
    ({"write": errno.EDQUOT}, lambda store, shard, tables: store.commit("ckpt-000000010", {}),
     r"cannot write \S+/ckpt-000000010/MANIFEST\.json\.tmp-\w+: Disk quota exceeded \(EDQUOT\)$"),
    ({"ls": errno.EIO}, lambda store, shard, tables: store.complete(),
     r"^checkpoint directory \S+: cannot list \S+: Input/output error \(EIO\)$"),
    ({"rm": errno.EACCES}, lambda store, shard, tables: store.prune(1),
     r"^checkpoint ckpt-000000010: cannot delete \S+/ckpt-000000010: Permission denied \(EACCES\)$"),
    ({"rm": errno.EPERM}, lambda store, shard, tables: store.uncommit("ckpt-000000020"),
     r"^checkpoint ckpt-000000020: cannot remove \S+/ckpt-000000020/MANIFEST\.json: Operation not permitted"),
    ({"read": errno.EIO}, lambda store, shard, tables: RestoreSource(store, "ckpt-000000020"),
     r"^checkpoint ckpt-000000020: cannot read \S+/ckpt-000000020/MANIFEST\.json: Input/output error \(EIO\)$"),
], ids=["mkdir", "write", "commit", "list", "delete", "uncommit", "read"])
def test_every_filesystem_error_is_a_checkpoint_error_with_the_path_and_the_reason(tmp_path, fail, act, says):
    store, shard, tables = written(tmp_path, (10, 20))
    before = files(tmp_path)
    failing = CheckpointStore(str(tmp_path), fs=Disk(fail=fail))
    with pytest.raises(CheckpointError, match=says):
        act(failing, shard, tables)
    assert temporary(tmp_path) == [] and files(tmp_path) == before  # nothing half-written stays
    assert store.complete() == ["ckpt-000000010", "ckpt-000000020"] and store.verify("ckpt-000000020")["step"] == 20


@pytest.mark.parametrize("call, code, says", [
    ("fsync", errno.EIO, rf"cannot fsync \S+/shard-0\.safetensors{TMP}: Input/output error \(EIO\)$"),
    ("replace", errno.EXDEV, rf"cannot rename \S+/shard-0\.safetensors{TMP} to "
                             r"\S+/ckpt-000000020/shard-0\.safetensors: Invalid cross-device link \(EXDEV\)$"),
], ids=["fsync", "rename"])
def test_a_failed_fsync_or_rename_is_a_checkpoint_error_and_the_temporary_file_goes(tmp_path, monkeypatch, call, code,
                                                                                      says):
    store, shard, tables = written(tmp_path)

    def failing(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    with monkeypatch.context() as patch:
        patch.setattr(os, call, failing)
        with pytest.raises(CheckpointError, match=rf"^checkpoint ckpt-000000020: {says}"):
            shard_file.write(store, "ckpt-000000020", shard, tables)
    assert files(tmp_path / "ckpt-000000020") == []


def test_a_read_only_directory_fails_every_write_and_still_reads(tmp_path):
    store, shard, tables = written(tmp_path)
    before = files(tmp_path)
    denied = r"(Permission denied \(EACCES\)|Read-only file system \(EROFS\))"
    with read_only(tmp_path) as fs:  # chmod, or as root (whom chmod does not stop) a filesystem saying EROFS
        store = CheckpointStore(str(tmp_path), fs=fs)
        with pytest.raises(CheckpointError,
                           match=rf"^checkpoint ckpt-000000020: cannot create directory \S+: {denied}$"):
            shard_file.write(store, "ckpt-000000020", shard, tables)
        with pytest.raises(CheckpointError, match=rf"^checkpoint ckpt-000000010: cannot write \S+/ckpt-000000010/"
                                                  rf"shard-0\.safetensors{TMP}: {denied}$"):
            shard_file.write(store, "ckpt-000000010", shard, tables)
        with pytest.raises(CheckpointError, match=rf"cannot remove \S+/MANIFEST\.json: {denied}$"):
            store.uncommit("ckpt-000000010")
        assert store.complete() == ["ckpt-000000010"] and RestoreSource.latest(store).step == 10
        assert [row["status"] for row in tools.list_checkpoints(str(tmp_path))] == ["ok"]
    assert files(tmp_path) == before


def test_temporary_files_a_killed_writer_left_go_at_the_next_write_of_that_file_or_at_a_sweep(tmp_path):
    store, shard, tables = written(tmp_path)
    dead = tmp_path / "ckpt-000000020"
    dead.mkdir()
    for name in ("shard-0.safetensors.tmp-0badf00d", "shard-1.safetensors.tmp-deadbeef"):
        (dead / name).write_bytes(b"partial")
    (tmp_path / "ckpt-000000010" / "MANIFEST.json.tmp-12345678").write_bytes(b"{")
    shard_file.write(store, "ckpt-000000020", shard, tables)  # shard 0 again: its dead temporary file goes
    assert files(dead) == ["shard-0.safetensors", "shard-1.safetensors.tmp-deadbeef"]
    removed = store.remove_temporary()  # what the chief does before its first checkpoint
    assert sorted(os.path.basename(path) for path in removed) == ["MANIFEST.json.tmp-12345678",
                                                                  "shard-1.safetensors.tmp-deadbeef"]
    assert temporary(tmp_path) == [] and store.complete() == ["ckpt-000000010"]


# ---- retention and `checkpoint list`: verified checkpoints only ------------------------------

def corrupt(directory, how: str, shard: int = 0) -> None:
    path = directory / f"shard-{shard}.safetensors"
    if how == "truncated":
        path.write_bytes(path.read_bytes()[:-7])
    elif how == "flipped":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "missing":
        path.unlink()
    else:
        (directory / "MANIFEST.json").write_text("{not json")


def test_retention_counts_only_verified_checkpoints_so_damaged_newer_ones_never_delete_a_good_one(tmp_path):
    shards, tables, _ = cluster(1)
    for step, how in ((100, "truncated"), (200, "flipped"), (300, "missing"), (400, "manifest")):
        save(tmp_path, shards, tables, step)  # an earlier run's, damaged since
        corrupt(tmp_path / checkpoint_name(step), how)
    (tmp_path / "ckpt-000000005").mkdir()  # an incomplete one, older than all
    store = CheckpointStore(str(tmp_path))  # the new run's
    for step in (10, 20):
        save(tmp_path, shards, tables, step, store)
        assert store.prune(3, protect=checkpoint_name(step)) == []  # fewer than 3 verified: nothing goes
    save(tmp_path, shards, tables, 30, store)
    assert store.prune(3, protect="ckpt-000000030") == ["ckpt-000000005"]  # older than the 3 kept
    save(tmp_path, shards, tables, 40, store)
    assert store.prune(3, protect="ckpt-000000040") == ["ckpt-000000010"]
    corrupt(tmp_path / "ckpt-000000040", "truncated")  # damaged after it was written (and counted)
    save(tmp_path, shards, tables, 50, store)
    assert store.prune(3, protect="ckpt-000000050") == []  # 50, 30 and 20 are the 3 kept
    save(tmp_path, shards, tables, 60, store)
    assert store.prune(3, protect="ckpt-000000060") == ["ckpt-000000020"]
    # the damaged ones newer than the kept stay for `checkpoint list` to show; resume skips them
    assert store.complete() == [checkpoint_name(s) for s in (30, 40, 50, 60, 100, 200, 300, 400)]
    assert RestoreSource.latest(store).step == 60


def test_the_checkpoint_just_written_stays_when_an_earlier_runs_newer_ones_fill_keep(tmp_path):
    shards, tables, _ = cluster(1)
    for step in (100, 200):
        save(tmp_path, shards, tables, step)
    store, _ = save(tmp_path, shards, tables, 10, CheckpointStore(str(tmp_path)))
    assert store.prune(2, protect="ckpt-000000010") == []
    save(tmp_path, shards, tables, 20, store)
    assert store.prune(2, protect="ckpt-000000020") == ["ckpt-000000010"]


def test_checkpoint_list_flags_each_damaged_checkpoint_with_what_is_wrong(tmp_path):
    shards, tables, _ = cluster(2)
    for step in (10, 20, 30, 40, 50):
        save(tmp_path, shards, tables, step)
    corrupt(tmp_path / "ckpt-000000020", "flipped", shard=1)
    corrupt(tmp_path / "ckpt-000000030", "truncated")
    corrupt(tmp_path / "ckpt-000000040", "manifest")
    corrupt(tmp_path / "ckpt-000000050", "missing", shard=1)
    (tmp_path / "ckpt-000000060").mkdir()  # incomplete: not a checkpoint
    rows = tools.list_checkpoints(str(tmp_path))
    assert [row["name"] for row in rows] == [checkpoint_name(s) for s in (10, 20, 30, 40, 50)]
    status = {row["name"]: row["status"] for row in rows}
    assert status["ckpt-000000010"] == "ok"
    assert status["ckpt-000000020"] == ("damaged: shard file shard-1.safetensors does not match its SHA-256 "
                                        "(changed after it was written)")
    assert re.fullmatch(r"damaged: shard file shard-0\.safetensors has \d+ bytes, the manifest says \d+ "
                        r"\(truncated\?\)", status["ckpt-000000030"])
    assert status["ckpt-000000040"].startswith("damaged: MANIFEST.json is not valid JSON")
    assert status["ckpt-000000050"] == "damaged: shard file shard-1.safetensors named by the manifest is missing"
    assert rows[1]["step"] == 20 and rows[1]["shards"] == 2  # a damaged one whose manifest reads keeps its figures


def test_checkpoint_list_flags_checkpoints_it_cannot_read(tmp_path, monkeypatch):
    written(tmp_path, (10,))
    failing = CheckpointStore(str(tmp_path), fs=Disk(fail={"read": errno.EIO}))
    monkeypatch.setattr(tools, "CheckpointStore", lambda url: failing)
    [row] = tools.list_checkpoints(str(tmp_path))
    assert re.fullmatch(r"damaged: cannot read \S+/ckpt-000000010/MANIFEST\.json: Input/output error \(EIO\)",
                        row["status"])


def test_checkpoint_list_of_a_directory_that_is_not_there_is_an_error_naming_it(tmp_path):
    with pytest.raises(CheckpointError, match=f"^checkpoint directory {re.escape(str(tmp_path / 'gone'))} does not "
                                              "exist$"):
        tools.list_checkpoints(str(tmp_path / "gone"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is not a directory"):
        tools.list_checkpoints(str(tmp_path / "file"))
    with pytest.raises(CheckpointError, match="does not exist"):
        tools.inspect(str(tmp_path / "gone"))
    assert tools.list_checkpoints(str(tmp_path)) == []  # there, and empty: no error


def test_a_worker_the_checkpoint_does_not_name_resumes_at_zero_not_at_its_step(tmp_path):
    # a worker still restarting when a roll-back's first checkpoint is written pushed nothing that
    # it holds: resuming at the checkpoint's step would skip batches no PS ever applied
    shards, tables, parts = cluster(2)
    for _ in range(3):
        for shard, held in parts.items():
            shards[shard].push(Push({name: np.full(v.shape, 0.5, np.float32) for name, v in held.items()}, worker=0))
    save(tmp_path, shards, tables, step=15)
    source = RestoreSource.latest(CheckpointStore(str(tmp_path)))
    assert (source.position(None), source.position(0), source.position(1)) == (15, 3, 0)
