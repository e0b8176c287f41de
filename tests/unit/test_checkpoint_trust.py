"""A checkpoint is data, never instructions: a matrix of crafted checkpoints (files outside the
directory, /dev/zero, missing and mistyped fields, parts that overlap or leave a gap, NaN, names
with lone surrogates, a huge manifest), each listed as damaged with a named reason and skipped by a
resume, which falls back to the good checkpoint before it. Every crafted file keeps a manifest
entry that matches its bytes, so what refuses it is the check under test, not the SHA-256."""

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors import numpy as safetensors_numpy
from safetensors import safe_open
from tests.unit.test_checkpoint_files import cluster, save, train

from paramserver.checkpoint import tools
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointStore, checkpoint_name

GOOD, CRAFTED = checkpoint_name(10), checkpoint_name(20)


def two_checkpoints(tmp_path: Path) -> CheckpointStore:
    """Checkpoints at steps 10 and 20 of a 2-shard model (w split over both shards, a table)."""
    shards, tables, parts = cluster(2)
    train(shards, tables, parts)
    save(tmp_path, shards, tables, step=10)
    train(shards, tables, parts)
    save(tmp_path, shards, tables, step=20)
    return CheckpointStore(str(tmp_path))


def rewrite(tmp_path: Path, index: int, meta=None, tensors=None, name: str = CRAFTED) -> None:
    """Rewrite shard file `index` of checkpoint `name` through `meta(dict)` and `tensors(dict)`
    (each changes in place), and its manifest entry to match the new bytes."""
    path = tmp_path / name / f"shard-{index}.safetensors"
    with safe_open(str(path), "np") as handle:
        data = json.loads(handle.metadata()["paramserver"])
        arrays = {key: handle.get_tensor(key) for key in handle.keys()}
    if meta is not None:
        meta(data)
    if tensors is not None:
        tensors(arrays)
    path.write_bytes(safetensors_numpy.save(arrays, metadata={"paramserver": json.dumps(data)}))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest_entry(tmp_path, index, name=name, bytes=path.stat().st_size, sha256=digest)


def manifest_entry(tmp_path: Path, index: int, name: str = CRAFTED, **changes) -> None:
    path = tmp_path / name / "MANIFEST.json"
    manifest = json.loads(path.read_text())
    manifest["shards"][index].update(changes)
    path.write_text(json.dumps(manifest))


def rename_part(arrays: dict, old: str, new: str) -> None:
    for key in [k for k in arrays if k.startswith(f"dense/g/{old}")]:
        arrays[key.replace(old, new, 1)] = arrays.pop(key)


def move_part(new: str):
    def meta(data):
        data["groups"]["g"]["steps"][new] = data["groups"]["g"]["steps"].pop("w[5:10]")

    return meta


def link(target: str):
    def craft(tmp_path: Path) -> None:
        path = tmp_path / CRAFTED / "shard-1.safetensors"
        path.unlink()
        os.symlink(target if target.startswith("/") else str(tmp_path / target), path)

    return craft


CASES = {
    "manifest file outside": (
        lambda p: manifest_entry(p, 1, file="../ckpt-000000010/shard-1.safetensors"), "names '../ckpt"
    ),
    "manifest file absolute": (lambda p: manifest_entry(p, 1, file="/dev/zero", bytes=1 << 40), "names '/dev/zero'"),
    "link to /dev/zero": (link("/dev/zero"), "not a regular file in the checkpoint's directory"),
    "link outside": (link(f"{GOOD}/shard-1.safetensors"), "not a regular file in the checkpoint's directory"),
    "groups missing": (lambda p: rewrite(p, 1, meta=lambda d: d.pop("groups")), "groups: Field required"),
    "positions odd": (lambda p: rewrite(p, 0, meta=lambda d: d.update(positions={"x": 1})), r"positions\.x"),
    "position a string": (lambda p: rewrite(p, 0, meta=lambda d: d.update(positions={"0": "5"})), r"positions\.0"),
    "counter negative": (
        lambda p: rewrite(p, 0, meta=lambda d: d["tables"]["t"]["counters"].update(admitted=-1)),
        r"tables\.t\.counters\.admitted",
    ),
    "lone surrogate name": (
        lambda p: rewrite(p, 0, meta=lambda d: d["groups"].update({"\ud800": d["groups"]["g"]})),
        r"groups\..*not a name: must not hold a lone surrogate",
    ),
    "step not a count": (
        lambda p: (p / CRAFTED / "MANIFEST.json").write_text(
            json.dumps({**json.loads((p / CRAFTED / "MANIFEST.json").read_text()), "step": "20"})
        ),
        "has step '20', not a count",
    ),
    "parts overlap": (
        lambda p: rewrite(p, 1, meta=move_part("w[4:9]"), tensors=lambda a: rename_part(a, "w[5:10]", "w[4:9]")),
        r"do not tile it \('w\[4:9\]' in shard-1.safetensors starts at row 4, not 5\)",
    ),
    "parts leave a gap": (
        lambda p: rewrite(p, 1, meta=move_part("w[6:11]"), tensors=lambda a: rename_part(a, "w[5:10]", "w[6:11]")),
        "starts at row 6, not 5",
    ),
    "part rows not its name's": (
        lambda p: rewrite(p, 1, meta=move_part("w[5:9]"), tensors=lambda a: rename_part(a, "w[5:10]", "w[5:9]")),
        "not the rows its name says",
    ),
    "state of another shape": (
        lambda p: rewrite(p, 1, tensors=lambda a: a.update({"dense/g/w[5:10]/momentum_buffer": np.zeros(3)})),
        "optimizer state 'dense/g/w\\[5:10\\]/momentum_buffer' has shape",
    ),
    "NaN in a table": (
        lambda p: rewrite(p, 0, tensors=lambda a: a["table/t/values"].__setitem__((0, 0), np.nan)),
        "'table/t/values' holds NaN or infinite values",
    ),
    "infinity in a dense part": (
        lambda p: rewrite(p, 1, tensors=lambda a: a["dense/g/w[5:10]"].__setitem__((0, 0), np.inf)),
        r"'dense/g/w\[5:10\]' holds NaN or infinite values",
    ),
    "huge manifest": (
        lambda p: (p / CRAFTED / "MANIFEST.json").write_bytes(b" " * ((16 << 20) + 1)),
        "MANIFEST.json is larger than",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_crafted_checkpoint_is_damaged_in_list_and_resume_falls_back_to_the_one_before(tmp_path, case, caplog):
    store = two_checkpoints(tmp_path)
    craft, reason = CASES[case]
    craft(tmp_path)
    listed = {row["name"]: row["status"] for row in tools.list_checkpoints(str(tmp_path))}
    assert listed[GOOD] == "ok"
    assert listed[CRAFTED].startswith("damaged: "), listed
    assert re.search(reason, listed[CRAFTED]), (case, listed[CRAFTED])
    source = RestoreSource.latest(store)
    assert source is not None and source.name == GOOD
    assert any(CRAFTED in r.getMessage() and re.search(reason, r.getMessage()) for r in caplog.records), case


def test_non_finite_values_are_restored_only_when_asked(tmp_path):
    store = two_checkpoints(tmp_path)
    CASES["NaN in a table"][0](tmp_path)
    assert RestoreSource.latest(store).name == GOOD
    source = RestoreSource.latest(store, allow_non_finite=True)
    assert source.name == CRAFTED and source.step == 20
