"""One verdict (checkpoint/verdict.py): a checkpoint that restore would refuse is refused before it is
chosen, by `checkpoint list`, resume (`RestoreSource.latest`, which falls back to the one before),
export and serving alike, and retention never deletes the newest one that passes. Each crafted file
keeps a manifest entry that matches its bytes, so what refuses it is the check under test, not the
SHA-256: rows counts that disagree, an id twice, a delta on a parent of another dim, an int8 table
whose encoding field was removed, an int8 code -128 whose scale overflows, a count that lies. Deleted
ids are read in bounded memory."""

import hashlib
import json
import tracemalloc

import numpy as np
import pytest
import torch
from safetensors import numpy as safetensors_numpy
from safetensors import safe_open
from tests.unit.test_checkpoint_files import cluster, train
from tests.unit.test_checkpoint_trust import CRAFTED, GOOD, manifest_entry, rewrite, two_checkpoints
from tests.unit.test_incremental_checkpoints import Cluster, restored
from tests.unit.test_quantized_checkpoints import craft, quantized_cluster

import paramserver as ps
from paramserver.checkpoint import chain, tools
from paramserver.checkpoint.files import chunks, shard_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointError, CheckpointStore, checkpoint_name
from paramserver.checkpoint.verdict import check_checkpoint, newest_passing_name, verdict


class Model(torch.nn.Module):
    """The model of test_checkpoint_files' checkpoints: dense w and b, and table t of dim 2."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(10, 4))
        self.b = torch.nn.Parameter(torch.zeros(3))
        self.t = ps.nn.HashEmbedding(2, name="t")


def refused_everywhere(store: CheckpointStore, name: str, reason: str, fallback: str | None, tmp_path) -> None:
    """`name` is damaged in `checkpoint list` naming `reason`, skipped by resume for `fallback`,
    and refused by the verdict, export and serving with a CheckpointError naming it."""
    listed = {row["name"]: row["status"] for row in tools.list_checkpoints(store.url)}
    assert listed[name].startswith("damaged: ") and reason in listed[name], listed
    latest = RestoreSource.latest(CheckpointStore(store.url))
    assert (latest.name if latest else None) == fallback
    assert newest_passing_name(CheckpointStore(store.url)) == fallback
    assert reason in (verdict(CheckpointStore(store.url), name) or "")
    with pytest.raises(CheckpointError, match=name):
        check_checkpoint(CheckpointStore(store.url), name)
    with pytest.raises(CheckpointError):
        tools.export(store.url, name, str(tmp_path / "export.safetensors"))
    with pytest.raises(CheckpointError):
        ps.serving.load(Model(), store.url, checkpoint=name)


def _short(key):
    return lambda arrays: arrays.update({key: arrays[key][:-1].copy()})


def _ids_twice(arrays):
    arrays["table/t/ids"][1] = arrays["table/t/ids"][0]


FINDING_3 = {
    "values fewer than ids": (_short("table/t/values"), "its values must be float32 of shape"),
    "state fewer than ids": (_short("table/t/sum"), "holds"),
    "an id twice": (_ids_twice, "twice"),
}


@pytest.mark.parametrize("case", sorted(FINDING_3))
def test_a_table_restore_would_refuse_is_refused_before_it_is_chosen(tmp_path, case):
    store = two_checkpoints(tmp_path)
    change, reason = FINDING_3[case]
    rewrite(tmp_path, 0, tensors=change)  # its metadata still says the ids' count
    refused_everywhere(store, CRAFTED, reason, GOOD, tmp_path)


def test_an_id_in_another_shards_file_is_refused(tmp_path):
    """An id in two files, or one that hashes to another shard: a restore onto as many shards would
    drop it unseen (each shard keeps its own ids), one onto another count would find it twice."""
    store = two_checkpoints(tmp_path)
    with safe_open(str(tmp_path / CRAFTED / "shard-1.safetensors"), "np") as handle:
        other = int(handle.get_tensor("table/t/ids")[0])
    rewrite(tmp_path, 0, tensors=lambda arrays: arrays["table/t/ids"].__setitem__(0, other))
    refused_everywhere(store, CRAFTED, "which belongs to shard 1 of 2", GOOD, tmp_path)


def chain_of_two(tmp_path) -> Cluster:
    cluster = Cluster(tmp_path)
    cluster.train(2, universe=100)
    cluster.checkpoint(1, delta=False)
    cluster.train(4, universe=50)  # ids 50..99 are not looked up again: evicted, deleted in the delta
    cluster.checkpoint(2)
    return cluster


def test_a_delta_whose_ids_and_rows_differ_is_refused(tmp_path):
    cluster = chain_of_two(tmp_path)
    rewrite(tmp_path / "chain", 0, tensors=_short("table/t/values"), name=checkpoint_name(2))
    refused_everywhere(
        cluster.chain, checkpoint_name(2), "its values must be float32 of shape", checkpoint_name(1), tmp_path
    )


def test_a_delta_whose_rows_count_lies_is_refused_before_anything_is_allocated(tmp_path):
    cluster = chain_of_two(tmp_path)
    rewrite(tmp_path / "chain", 0, meta=lambda d: d["tables"]["t"].update(rows=10**12), name=checkpoint_name(2))
    tracemalloc.start()
    try:
        refused_everywhere(cluster.chain, checkpoint_name(2), "says 1000000000000 rows", checkpoint_name(1), tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_a_delta_on_a_parent_of_another_dim_is_refused(tmp_path):
    cluster = chain_of_two(tmp_path)

    def widen(arrays):
        for key in ("table/t/values", "table/t/sum"):
            arrays[key] = np.concatenate([arrays[key], np.zeros((arrays[key].shape[0], 1), np.float32)], axis=1)

    rewrite(
        tmp_path / "chain", 0, meta=lambda d: d["tables"]["t"].update(dim=5), tensors=widen, name=checkpoint_name(1)
    )
    assert verdict(CheckpointStore(cluster.chain.url), checkpoint_name(1)) is None  # a table of dim 5, whole
    refused_everywhere(cluster.chain, checkpoint_name(2), "whose table 't' has dim 5", checkpoint_name(1), tmp_path)


def test_an_int8_table_whose_encoding_field_was_removed_is_refused(tmp_path):
    cluster = quantized_cluster(tmp_path, "int8", steps=2, num_ps=1)
    craft(cluster.whole, checkpoint_name(2), lambda meta, arrays: meta["tables"]["t"].pop("encoding"))
    refused_everywhere(
        cluster.whole,
        checkpoint_name(2),
        "is float32-encoded, its values must be float32",
        checkpoint_name(1),
        tmp_path,
    )


def test_an_int8_code_of_minus_128_whose_scale_overflows_is_refused(tmp_path):
    cluster = quantized_cluster(tmp_path, "int8", steps=2, num_ps=1)
    near_max = np.float32(np.finfo(np.float32).max / np.float32(127)) * np.float32(0.9999)
    assert np.isinf(np.float32(-128) * near_max) and np.isfinite(np.float32(127) * near_max)

    def change(meta, arrays):
        arrays["table/t/values"][0, 0] = -128
        arrays["table/t/values.scale"][0] = near_max

    craft(cluster.whole, checkpoint_name(2), change)
    refused_everywhere(
        cluster.whole,
        checkpoint_name(2),
        "holds a scale that is negative, not finite or above",
        checkpoint_name(1),
        tmp_path,
    )


def peaks_reading(tmp_path, many: int) -> dict[str, int]:
    """Peak bytes allocated by list, resume and export of a delta with `many` deleted ids more (none of
    them a row: the rows count holds), each read checked against the whole checkpoint's."""
    cluster = chain_of_two(tmp_path)
    name = checkpoint_name(2)
    more = np.arange(many, dtype=np.int64) + 10**12
    rewrite(
        tmp_path / "chain",
        0,
        name=name,
        tensors=lambda arrays: arrays.update({"table/t/deleted": np.concatenate([arrays["table/t/deleted"], more])}),
    )
    expected = restored(cluster.whole, name, 1)
    peaks = {}
    for reader, read in {
        "list": lambda: tools.list_checkpoints(cluster.chain.url),
        "resume": lambda: restored(CheckpointStore(cluster.chain.url), name, 1),
        "export": lambda: tools.export(cluster.chain.url, name, str(tmp_path / "e.safetensors")),
    }.items():
        tracemalloc.start()
        try:
            got = read()
            peaks[reader] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        if reader == "resume":
            assert got[0][0]["ids"].tobytes() == expected[0][0]["ids"].tobytes()
            assert got[0][0]["values"].tobytes() == expected[0][0]["values"].tobytes()
        if reader == "list":
            assert {row["name"]: row["status"] for row in got}[name] == "ok"
    return peaks


def test_deleted_ids_are_read_in_bounded_memory(tmp_path, monkeypatch):
    # Every size a quarter of what it was (the slice, the ids held per pass, both id counts and the
    # bound): the same passes (8 and 32), and the same ratio of the ids added (1.8 MB) to the bound
    # that reading them all at once would break; a quarter of the time.
    monkeypatch.setattr(chain, "SLICE_BYTES", 1 << 16)
    monkeypatch.setattr(chain, "MENTIONS_PER_PASS", 1 << 14, raising=False)
    few, many = peaks_reading(tmp_path / "few", 75_000), peaks_reading(tmp_path / "many", 300_000)
    for reader in few:  # 1.8 MB more deleted ids: the same peak (what grows with them is read a slice at a time)
        assert many[reader] - few[reader] < 512 << 10, (reader, few, many)


def test_retention_never_deletes_the_newest_checkpoint_that_passes(tmp_path):
    two_checkpoints(tmp_path)
    rewrite(tmp_path, 0, tensors=_ids_twice)  # hashes match: only the verdict finds it
    store = CheckpointStore(str(tmp_path))
    assert store.prune(1) == []  # the crafted one does not count: fewer than 1 good, nothing deleted
    assert (tmp_path / GOOD / "MANIFEST.json").exists()
    assert verdict(CheckpointStore(str(tmp_path)), GOOD) is None


def _entry(path, index):
    data = path.read_bytes()
    return {"index": index, "file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_a_checkpoint_is_checked_before_its_manifest_is_written(tmp_path):
    shards, tables, parts = cluster(2)
    train(shards, tables, parts)
    store, name = CheckpointStore(str(tmp_path)), checkpoint_name(5)
    entries = [shard_file.write(store, name, s, t).__dict__ for s, t in zip(shards, tables)]
    manifest = {"step": 5, "num_shards": 2, "shards": entries}
    short = {**manifest, "shards": [{**entries[0], "bytes": entries[0]["bytes"] + 1}, entries[1]]}
    with pytest.raises(CheckpointError, match="shard-0.safetensors has .* bytes, the manifest says"):
        check_checkpoint(store, name, short)
    path = tmp_path / name / "shard-0.safetensors"
    good = path.read_bytes()
    with safe_open(str(path), "np") as handle:
        metadata = handle.metadata()
        arrays = {key: handle.get_tensor(key) for key in handle.keys()}
    _ids_twice(arrays)
    metadata.pop(chunks.KEY)  # a file without chunk hashes (as older ones): its structure must refuse it
    path.write_bytes(safetensors_numpy.save(arrays, metadata=metadata))
    with pytest.raises(CheckpointError, match="holds id .* twice"):  # the structure, as restore checks it
        check_checkpoint(store, name, {**manifest, "shards": [_entry(path, 0), entries[1]]})
    path.write_bytes(good)
    with pytest.raises(CheckpointError, match="not a count"):
        check_checkpoint(store, name, {**manifest, "step": "5"})
    assert not (tmp_path / name / "MANIFEST.json").exists()
    check_checkpoint(store, name, manifest)
    store.commit(name, manifest)
    assert name in store._good  # it passed before its commit: retention does not read it again
    assert verdict(CheckpointStore(str(tmp_path)), name) is None
    manifest_entry(tmp_path, 0, name=name, sha256="1" * 64)
    assert "SHA-256" in verdict(CheckpointStore(str(tmp_path)), name)
    json.loads((tmp_path / name / "MANIFEST.json").read_text())
