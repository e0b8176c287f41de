"""Serving checks what it is handed as restore checks a checkpoint: NaN and infinite values, weights
and ids of another dtype, ids that do not match the rows one for one, an id twice, a delta of another
run or checkpoint content under the same name, a model parameter the file lacks (strict), a count the
files cannot hold: each refused with an error naming it, before the model changes; and a delta is
applied in memory bounded by the tables it leaves, not by multiples of the delta."""

import gc
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from tests.unit.test_incremental_checkpoints import Cluster

import paramserver as ps
from paramserver.checkpoint.export import delta_export
from paramserver.checkpoint.export import export_file as export_reader
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import MANIFEST, CheckpointError, CheckpointStore, checkpoint_name
from paramserver.serving.checkpoint_model import load_into

DIM = 4
BASE = {"checkpoint": checkpoint_name(5), "checkpoint_sha256": "a" * 64, "run_id": "run-a"}


class Small(torch.nn.Module):
    def __init__(self, dim=DIM):
        super().__init__()
        self.user = ps.nn.HashEmbedding(dim)
        self.fc = torch.nn.Linear(dim, 1)


def tensors(ids=(1, 2, 3), dim=DIM, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "fc.weight": rng.normal(size=(1, dim)).astype(np.float32),
        "fc.bias": np.zeros(1, np.float32),
        "embeddings/user/ids": np.asarray(ids, np.int64),
        "embeddings/user/weight": rng.normal(size=(len(ids), dim)).astype(np.float32),
    }


def export_file(path, tensors, **metadata):
    save_file(tensors, str(path), metadata={"format": "paramserver-export", "step": "5", **BASE, **metadata})
    return str(path)


def delta_file(path, tensors, deleted=(), since=BASE, **metadata):
    tensors = {**tensors, "embeddings/user/deleted": np.asarray(deleted, np.int64)}
    meta = {
        "format": "paramserver-export-delta",
        "step": "7",
        "checkpoint": checkpoint_name(7),
        "checkpoint_sha256": "b" * 64,
        "run_id": "run-a",
        "since": since["checkpoint"],
        "since_step": "5",
        "since_sha256": since["checkpoint_sha256"],
        "since_run_id": since["run_id"],
        **metadata,
    }
    save_file(tensors, str(path), metadata=meta)
    return str(path)


def unchanged(model, before):
    return model.user.served is None and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def nan_row(t):
    t["embeddings/user/weight"][1, 2] = np.nan


def inf_row(t):
    t["embeddings/user/weight"][2, 0] = -np.inf


def nan_dense(t):
    t["fc.weight"][0, 1] = np.nan


BAD_FILES = {  # what is wrong -> (how to make it, the error that names it)
    "nan-row": (nan_row, r"table 'user' holds NaN or infinite values"),
    "inf-row": (inf_row, r"table 'user' holds NaN or infinite values"),
    "nan-dense": (nan_dense, r"variable 'fc.weight' holds NaN or infinite values"),
    "int32-weight": (
        lambda t: t.update({"embeddings/user/weight": t["embeddings/user/weight"].astype(np.int32)}),
        r"table 'user' weight is int32 .*not float32",
    ),
    "float16-weight": (
        lambda t: t.update({"embeddings/user/weight": t["embeddings/user/weight"].astype(np.float16)}),
        r"table 'user' weight is float16 .*not float32",
    ),
    "float16-dense": (lambda t: t.update({"fc.bias": t["fc.bias"].astype(np.float16)}), r"'fc.bias' is float16"),
    "fewer-ids": (lambda t: t.update({"embeddings/user/ids": np.array([1, 2], np.int64)}), r"2 ids for 3 weight rows"),
    "more-ids": (lambda t: t.update({"embeddings/user/ids": np.arange(4, dtype=np.int64)}), r"4 ids for 3 weight rows"),
    "duplicate-ids": (lambda t: t.update({"embeddings/user/ids": np.array([7, 2, 7], np.int64)}), r"names id 7 twice"),
    "float64-ids": (
        lambda t: t.update({"embeddings/user/ids": np.array([1.0, 2.0, 3.0])}),
        r"table 'user' ids are float64 .*not 1-D int64",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_export_is_refused_naming_the_problem_and_the_model_is_unchanged(case, tmp_path):
    make, problem = BAD_FILES[case]
    bad = tensors()
    make(bad)
    path = export_file(tmp_path / "bad.safetensors", bad)
    model = Small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=problem):
        ps.serving.load(model, path)
    assert unchanged(model, before), case
    with pytest.raises(CheckpointError, match=problem):
        ps.load_export(path)


def test_non_finite_rows_are_served_when_asked(tmp_path):
    bad = tensors()
    nan_row(bad)
    model = Small()
    ps.serving.load(model, export_file(tmp_path / "nan.safetensors", bad), allow_non_finite=True)
    assert torch.isnan(model.user(torch.tensor([2]))).any() and not torch.isnan(model.user(torch.tensor([1]))).any()


@pytest.mark.parametrize("case", ["nan-row", "inf-row", "duplicate-ids", "more-ids", "float16-weight"])
def test_a_bad_delta_is_refused_naming_the_problem_and_the_served_model_is_unchanged(case, tmp_path):
    make, problem = BAD_FILES[case]
    model = Small()
    ps.serving.load(model, export_file(tmp_path / "base.safetensors", tensors()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = tensors(ids=(3, 4, 5), seed=1)
    make(bad)
    with pytest.raises(CheckpointError, match=problem):
        ps.serving.apply_delta(model, delta_file(tmp_path / "delta.safetensors", bad))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), case
    assert ps.serving.served(model).checkpoint == checkpoint_name(5)


@pytest.mark.parametrize(
    "since,problem",
    [
        ({**BASE, "run_id": "run-b"}, "run run-b"),
        ({**BASE, "checkpoint_sha256": "c" * 64}, "sha256 cccccccccccc"),
    ],
    ids=["another-run", "another-content"],
)
def test_a_delta_since_a_checkpoint_of_the_same_name_from_another_run_is_refused(since, problem, tmp_path):
    model = Small()
    ps.serving.load(model, export_file(tmp_path / "base.safetensors", tensors()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    other = delta_file(tmp_path / "other.safetensors", tensors(ids=(3, 4), seed=1), since=since)
    with pytest.raises(CheckpointError, match=rf"a delta since {BASE['checkpoint']} \(.*{problem}.*the model serves"):
        ps.serving.apply_delta(model, other)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    own = delta_file(tmp_path / "own.safetensors", tensors(ids=(3, 4), seed=1), deleted=[1])
    info = ps.serving.apply_delta(model, own)
    assert info["tables"]["user"] == {"rows": 2, "deleted": 1}
    assert model.user.served.ids.tolist() == [2, 3, 4]
    lineage = ps.serving.served(model)
    assert (lineage.checkpoint, lineage.sha256, lineage.run_id) == (checkpoint_name(7), "b" * 64, "run-a")


def test_a_delta_exported_from_another_run_with_the_same_checkpoint_names_is_refused(tmp_path):
    """Two runs write ckpt-000000001 and 2 in two directories: a model serving run A's checkpoint 1
    takes run A's delta 1 -> 2, never run B's (same names, other content)."""
    runs = [Cluster(tmp_path / run, num_ps=2, seed=seed) for seed, run in enumerate("ab")]
    for run in runs:
        for step in (1, 2):
            run.train(2)
            run.checkpoint(step)
    first, second = checkpoint_name(1), checkpoint_name(2)
    deltas = [
        delta_export.export_delta(run.chain.url, second, first, str(tmp_path / f"{k}.st")) for k, run in enumerate(runs)
    ]

    def served():
        model = torch.nn.Module()
        model.t = ps.nn.HashEmbedding(4, name="t")
        ps.serving.load(model, runs[0].chain.url, checkpoint=first)
        return model

    model = served()
    held = model.t.served.ids.clone()
    with pytest.raises(CheckpointError, match=f"is a delta since {first} .*the model serves {first} "):
        ps.serving.apply_delta(model, deltas[1])
    assert torch.equal(model.t.served.ids, held)
    ps.serving.apply_delta(model, deltas[0])
    assert ps.serving.served(model).checkpoint == second
    with pytest.raises(CheckpointError, match="does not apply to"):
        delta_export.apply_to_export(
            {"checkpoint": first, "embeddings": {}, "state_dict": {}}, delta_export.load_delta(deltas[0])
        )


def test_load_is_strict_about_what_the_file_lacks_unless_told(tmp_path):
    path = export_file(tmp_path / "model.safetensors", tensors())

    class Wider(Small):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(1, 1)
            self.item = ps.nn.HashEmbedding(DIM)

    model = Wider()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="no table for the model's HashEmbedding 'item'"):
        ps.serving.load(model, path)
    del model.item
    with pytest.raises(CheckpointError, match=r"lacks the model's parameter\(s\) head.weight, head.bias"):
        ps.serving.load(model, path)
    assert unchanged(model, before)
    model.item = ps.nn.HashEmbedding(DIM)
    info = ps.serving.load(model, path, strict=False)
    assert info["missing"] == ["head.weight", "head.bias", "item"] and info["unexpected"] == []
    assert torch.equal(model.head.weight, before["head.weight"])  # kept its value
    assert torch.equal(model.item(torch.tensor([1, 2])), torch.zeros(2, DIM))  # no table: zero rows
    assert torch.equal(model.fc.bias, torch.zeros(1))


def lie_about_rows(store: CheckpointStore, name: str, table: str, rows: int) -> None:
    """Rewrite every delta shard file of checkpoint `name` so that its metadata says `rows` rows of
    `table`, and its manifest entry so that the file's size and SHA-256 agree: a lie that every
    hash and size check passes."""
    directory = Path(store.url) / name
    manifest = json.loads((directory / MANIFEST).read_text())
    for entry in manifest["shards"]:
        path = directory / entry["file"]
        data = path.read_bytes()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
        meta = json.loads(header["__metadata__"]["paramserver"])
        assert meta.get("parent"), "a delta's file (a whole file's rows are checked against its ids)"
        meta["tables"][table]["rows"] = rows
        header["__metadata__"]["paramserver"] = json.dumps(meta)
        header["__metadata__"].pop("paramserver.chunks", None)  # as an older file: no header digest to say so
        body = json.dumps(header).encode()
        body += b" " * (-len(body) % 8)
        data = len(body).to_bytes(8, "little") + body + data[8 + length :]
        path.write_bytes(data)
        entry["bytes"], entry["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (directory / MANIFEST).write_text(json.dumps(manifest))


def test_a_manifest_that_lies_about_rows_is_refused_before_anything_is_allocated(tmp_path):
    cluster = Cluster(tmp_path, num_ps=2)
    for step in (1, 2):
        cluster.train(2)
        cluster.checkpoint(step)
    lie_about_rows(cluster.chain, checkpoint_name(2), "t", 10**12)  # 2 x 10^12 rows x 4 floats: 29 TiB
    model = torch.nn.Module()
    model.t = ps.nn.HashEmbedding(4, name="t")
    with pytest.raises(CheckpointError, match="[12]000000000000 rows"):  # a file's, or the tables'
        ps.serving.load(model, cluster.chain.url, checkpoint=checkpoint_name(2))
    assert model.t.served is None
    # by default, the newest checkpoint that passes, as resume chooses
    assert ps.serving.load(model, cluster.chain.url)["checkpoint"] == checkpoint_name(1)
    with pytest.raises(CheckpointError, match="[12]000000000000 rows"):  # the evaluator's reader too
        load_into(model, RestoreSource(cluster.chain, checkpoint_name(2)))


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def peak_growth(call):
    """(call(), how far this process's resident memory rose above where it was, in bytes)."""
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak (Linux)
    except OSError:
        pytest.skip("no /proc/self/clear_refs: cannot measure a peak")
    before = _status_kib("VmRSS")
    result = call()
    return result, (_status_kib("VmHWM") - before) << 10


def test_a_large_delta_is_applied_in_memory_bounded_by_the_new_table(tmp_path, monkeypatch):
    # a quarter of the rows and of the slice read at a time: the slice is the same share of the table
    # (1/13), so the bound below holds the same ratio of what a whole read (4x the table) would take
    monkeypatch.setattr(export_reader, "SLICE_BYTES", 2 << 20)
    dim, rows = 64, 100_000  # a 26 MB delta onto a table of 1,000 rows
    model = Small(dim)
    ps.serving.load(model, export_file(tmp_path / "base.safetensors", tensors(ids=range(1000), dim=dim)))
    big = tensors(ids=np.arange(500, 500 + rows), dim=dim, seed=1)
    path = delta_file(tmp_path / "delta.safetensors", big, deleted=np.arange(0, 100))
    expected = big["embeddings/user/weight"][-1].copy()
    table_bytes = (rows + 500) * (dim * 4 + 8)  # what the served table holds afterwards
    del big
    info, peak = peak_growth(lambda: ps.serving.apply_delta(model, path))
    assert info["tables"]["user"] == {"rows": rows, "deleted": 100}
    assert model.user.served.ids.shape[0] == rows + 400
    assert torch.equal(model.user(torch.tensor([499 + rows]))[0], torch.from_numpy(expected))
    size = Path(path).stat().st_size
    print(f"apply_delta of a {size >> 20} MB delta: peak +{peak >> 20} MB, table {table_bytes >> 20} MB")
    # the new table, a few arrays of ids and a slice of rows; the whole delta read at once and merged
    # in copies peaked at 4x the table
    assert peak < table_bytes * 1.5, f"peak {peak >> 20} MB for a {table_bytes >> 20} MB table"


def test_a_delta_that_does_not_name_its_base_exactly_is_refused(tmp_path):
    model = Small()
    ps.serving.load(model, export_file(tmp_path / "base.safetensors", tensors()))
    delta = tensors(ids=(3, 4), seed=1)
    delta["embeddings/user/deleted"] = np.zeros(0, np.int64)
    save_file(
        delta,
        str(tmp_path / "old.safetensors"),
        metadata={  # as deltas were written before lineage
            "format": "paramserver-export-delta",
            "step": "7",
            "checkpoint": checkpoint_name(7),
            "since": BASE["checkpoint"],
            "since_step": "5",
        },
    )
    with pytest.raises(CheckpointError, match=r"names no checkpoint_sha256 .*export it again"):
        ps.serving.apply_delta(model, str(tmp_path / "old.safetensors"))
    assert ps.serving.served(model).checkpoint == BASE["checkpoint"]
