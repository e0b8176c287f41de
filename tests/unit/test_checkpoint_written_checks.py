"""Written means checked to restore, at a cost that scales with the PS count: each PS checks its own
file as it writes it (every slice's values and row counts, its header and metadata read back and
parsed as restore parses them), and the chief's check before the commit (verdict with
contents=False) reads the files' headers only. A file that fails is never written, its Checkpoint
fails naming why, and nothing is committed."""

import contextlib
import json
import logging

import numpy as np
import pytest
from tests.unit.test_checkpoint_files import cluster, train
from tests.unit.test_checkpointer import Client, checkpointer, files

from paramserver.base.hashing import shard_of
from paramserver.checkpoint.files import shard_file, shard_meta, tensor_file
from paramserver.checkpoint.shard_writes import ShardWrites
from paramserver.checkpoint.store import CheckpointError, CheckpointStore, checkpoint_name, is_checkpoint_name
from paramserver.checkpoint.verdict import check_checkpoint
from paramserver.server.shard import Shard
from paramserver.tables.table_store import TableStore

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}


def written(tmp_path):
    """A two-shard checkpoint written by the real writers, not committed: (store, name, manifest)."""
    shards, tables, parts = cluster(2)
    train(shards, tables, parts)
    store, name = CheckpointStore(str(tmp_path)), checkpoint_name(5)
    entries = [shard_file.write(store, name, s, t).__dict__ for s, t in zip(shards, tables)]
    return store, name, {"step": 5, "num_shards": 2, "shards": entries}


def header_bytes(path) -> int:
    with open(path, "rb") as handle:
        return 8 + int.from_bytes(handle.read(8), "little")


class Counting:
    """A file handle that counts the bytes read through it."""

    def __init__(self, handle, counts):
        self.handle, self.counts = handle, counts

    def read(self, n=-1):
        data = self.handle.read(n)
        self.counts.append(len(data))
        return data

    def readinto(self, view):
        got = self.handle.readinto(view)
        self.counts.append(got or 0)
        return got

    def __getattr__(self, name):
        return getattr(self.handle, name)


def bytes_read(store: CheckpointStore, check, monkeypatch) -> int:
    """Bytes of shard files that `check()` reads through `store`."""
    counts = []
    opened = store.open_shard

    @contextlib.contextmanager
    def counting(checkpoint, entry):
        with opened(checkpoint, entry) as handle:
            yield Counting(handle, counts)

    monkeypatch.setattr(store, "open_shard", counting)
    check()
    return sum(counts)


def test_the_chiefs_check_reads_each_files_header_only(tmp_path, monkeypatch):
    store, name, manifest = written(tmp_path)
    headers = sum(header_bytes(tmp_path / name / f"shard-{i}.safetensors") for i in range(2))
    data = sum(entry["bytes"] for entry in manifest["shards"]) - headers
    read = bytes_read(store, lambda: check_checkpoint(store, name, manifest, contents=False), monkeypatch)
    assert 0 < read <= headers, (read, headers, data)  # not a byte of the values
    fresh = CheckpointStore(str(tmp_path))  # the full verdict, in a store that did not see it pass
    read = bytes_read(fresh, lambda: check_checkpoint(fresh, name, manifest), monkeypatch)
    assert read >= headers + data, (read, headers, data)


def test_values_turned_to_garbage_pass_the_chiefs_check_and_fail_the_full_verdict(tmp_path):
    store, name, manifest = written(tmp_path)
    path = tmp_path / name / "shard-0.safetensors"
    data = bytearray(path.read_bytes())
    start = header_bytes(path)
    data[start:] = b"\xff" * (len(data) - start)  # every value NaN, every id -1: the same size
    path.write_bytes(bytes(data))
    check_checkpoint(store, name, manifest, contents=False)  # the structure holds: the writers checked values
    garbage = "shard-0.safetensors: tensor .* (holds NaN or infinite values|does not match its SHA-256 at chunk)"
    with pytest.raises(CheckpointError, match=garbage):
        check_checkpoint(CheckpointStore(str(tmp_path)), name, manifest)
    short = {**manifest, "shards": [{**manifest["shards"][0], "bytes": len(data) - 1}, manifest["shards"][1]]}
    with pytest.raises(CheckpointError, match="shard-0.safetensors has .* bytes, the manifest says"):
        check_checkpoint(store, name, short, contents=False)  # sizes are the chief's to check


def one_table(encoding="none", bad=np.nan, allow_non_finite=False):
    """A shard holding table t of dim 4 whose row 3 holds `bad`, and a writer (`encoding`)."""
    tables = TableStore(0)
    tables.register("t", 4, ADAGRAD, {"kind": "normal", "std": 0.1})
    tables.lookup("t", np.arange(10, dtype=np.int64))
    tables.table("t").values[3, 1] = bad
    return Shard(0, tables=tables), tables


@pytest.mark.parametrize("encoding", ["none", "bf16", "int8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_writer_given_a_non_finite_row_refuses_to_write_it(tmp_path, encoding, bad):
    shard, _ = one_table(encoding, bad)
    writes = ShardWrites(str(tmp_path), encoding)
    with pytest.raises(
        CheckpointError,
        match=r"ckpt-000000001: shard-0.safetensors: tensor 'table/t/values' "
        r"holds NaN or infinite values; not written",
    ):
        writes(checkpoint_name(1), shard)
    assert not list(tmp_path.rglob("*.safetensors*"))  # no file, no temporary one
    allowed = ShardWrites(str(tmp_path), encoding, allow_non_finite=True)
    if encoding == "int8" and np.isnan(bad):  # a NaN row has a NaN scale: restore refuses it, allowed or not
        with pytest.raises(CheckpointError, match="'table/t/values.scale' holds a scale that is negative, not finite"):
            allowed(checkpoint_name(2), shard)
    else:
        assert allowed(checkpoint_name(2), shard)["bytes"] > 0  # restore_non_finite: written, as restore takes it


def test_a_writer_refuses_metadata_restore_would_refuse(tmp_path, monkeypatch):
    shard, _ = one_table(bad=0.0)
    monkeypatch.setattr(shard, "positions", lambda: {10**10: 1})  # a worker index of 11 digits
    with pytest.raises(CheckpointError, match=r"shard-0.safetensors: metadata is malformed \(positions"):
        ShardWrites(str(tmp_path))(checkpoint_name(1), shard)
    assert not list(tmp_path.rglob("*.safetensors*"))


class WritingClient(Client):
    """The shards write through the real writer (ShardWrites), and shard 0's table holds a NaN row."""

    def checkpoint(self, name, timeout):
        self.saved.append(name)
        shard, _ = one_table()
        return [ShardWrites(self.directory)(name, shard)]


def test_a_file_its_writer_refuses_is_a_failed_checkpoint_and_nothing_is_committed(tmp_path, caplog):
    chief, _, _ = checkpointer(tmp_path, 0)
    chief.client = WritingClient(None, str(tmp_path))
    with caplog.at_level(logging.ERROR, logger="paramserver.worker.recovery.checkpoints"):
        with pytest.raises(CheckpointError, match="table/t/values' holds NaN"):
            chief.save(5, 1.0)
    assert CheckpointStore(str(tmp_path)).complete() == [] and files(tmp_path) == []
    assert chief.counts()["checkpoints_written"] == 0 and chief.counts()["checkpoints_failed"] == 1
    assert "holds NaN or infinite values" in chief.counts()["checkpoint_error"]
    assert any("ckpt-000000005 failed" in record.getMessage() for record in caplog.records)


def test_rows_that_do_not_fit_their_tensor_are_refused(tmp_path):
    layout = tensor_file.plan({"a": (np.dtype(np.float32), (4, 2))}, {})
    with open(tmp_path / "f", "wb") as handle:
        for row, rows in (
            (3, np.zeros((2, 2), np.float32)),
            (0, np.zeros((1, 3), np.float32)),
            (0, np.zeros((1, 2), np.float64)),
        ):
            with pytest.raises(tensor_file.TensorFileError, match="'a': rows"):
                tensor_file.write_rows(handle, layout, "a", row, rows)


def test_only_ascii_checkpoint_names_are_names_and_listed(tmp_path):
    assert is_checkpoint_name("ckpt-000000007")
    for name in (
        "ckpt-000000007\n",
        "ckpt-00000000\u0667",
        "ckpt-\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff10\uff11",
    ):
        assert not is_checkpoint_name(name), ascii(name)
        (tmp_path / name).mkdir()
    assert CheckpointStore(str(tmp_path)).names() == []


def test_a_metadata_problem_is_one_line_whatever_the_key_holds():
    text = json.dumps({"shard": 0, "groups": {"a\nb\x1b[2J": {"spec": {}, "steps": {}}}, "tables": {}, "positions": {}})
    with pytest.raises(CheckpointError) as caught:
        shard_meta.parse(text, {}, "f")
    assert "\n" not in str(caught.value) and "\x1b" not in str(caught.value) and "a\\nb" in str(caught.value)


def test_a_writer_refuses_an_id_of_another_shard(tmp_path):
    tables = TableStore(1)
    tables.register("t", 4, ADAGRAD, {"kind": "zeros"}, num_shards=2)
    ids = np.arange(50, dtype=np.int64)
    tables.lookup("t", ids)  # a lookup sent to the wrong PS: half of them are shard 0's
    stray = int(ids[shard_of(ids, 2) == 0][0])
    with pytest.raises(
        CheckpointError,
        match=f"shard-1.safetensors: table 't' holds id {stray}, which belongs to shard 0 of 2; not written",
    ):
        ShardWrites(str(tmp_path))(checkpoint_name(1), Shard(1, tables=tables))
    assert not list(tmp_path.rglob("*.safetensors*"))


def test_the_chiefs_check_refuses_a_file_routed_over_another_shard_count(tmp_path):
    shards, tables, parts = cluster(2)
    train(shards, tables, parts)
    tables[0].shard_counts["t"] = 1  # its PS took the table as one of one shard: the file says so
    store, name = CheckpointStore(str(tmp_path)), checkpoint_name(5)
    entries = [shard_file.write(store, name, s, t).__dict__ for s, t in zip(shards, tables)]
    with pytest.raises(
        CheckpointError, match="shard-0.safetensors: table 't' was written routed over 1 shards, the checkpoint has 2"
    ):
        check_checkpoint(store, name, {"step": 5, "num_shards": 2, "shards": entries}, contents=False)
