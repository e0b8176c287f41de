"""Quantized rows (`checkpoint_quantize` bf16 / int8): a chain still restores what a whole checkpoint
restores, bit for bit, onto any number of shards; values come back within the encoding's rounding
and optimizer state exactly; export, inspect and safetensors read the files; and every encoded
tensor is checked before use (a crafted file is damaged, named, and resumed past)."""

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tests.unit.test_incremental_checkpoints import Cluster, assert_same, restored

from paramserver.base.errors import InvalidArgumentError
from paramserver.checkpoint import tools
from paramserver.checkpoint.files import quantize, shard_file, tensor_file
from paramserver.checkpoint.files.tensor_file import TensorReader
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.shard_writes import ShardWrites
from paramserver.checkpoint.store import CheckpointStore, checkpoint_name

ENCODINGS = ["bf16", "int8"]


def quantized_cluster(tmp_path, encoding, steps=4, num_ps=2):
    """`Cluster`'s run with every file (chain links and whole files) written in `encoding`."""
    cluster = Cluster(tmp_path, num_ps=num_ps)
    cluster.writes = [ShardWrites(str(tmp_path / "chain"), encoding) for _ in range(num_ps)]
    for step in range(1, steps + 1):
        cluster.train(3)
        name = checkpoint_name(step)
        entries = [w(name, s, parent=cluster.parent) for w, s in zip(cluster.writes, cluster.shards)]
        cluster.chain.commit(name, {"step": step, "num_shards": num_ps, "shards": entries})
        whole = [
            shard_file.write(cluster.whole, name, s, s.tables, encoding=encoding).__dict__ for s in cluster.shards
        ]
        cluster.whole.commit(name, {"step": step, "num_shards": num_ps, "shards": whole})
        cluster.parent = name
    return cluster


def by_id(arrays):
    order = np.argsort(arrays["ids"])
    return {key: array[order] for key, array in arrays.items()}


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_quantized_chain_restores_the_whole_checkpoint_and_values_within_the_rounding(tmp_path, encoding):
    cluster = quantized_cluster(tmp_path, encoding)
    for step in (2, 4):
        name = checkpoint_name(step)
        assert_same(restored(cluster.chain, name, 2), restored(cluster.whole, name, 2))
        assert_same(restored(cluster.chain, name, 3), restored(cluster.whole, name, 3))
    for index, shard in enumerate(cluster.shards):  # against the live rows of the last checkpoint
        table = shard.tables.table("t")
        live = by_id({key: table.array(key)[: table.size] for key in table.layout()})
        got = by_id(restored(cluster.chain, checkpoint_name(4), 2)[index][0])
        assert np.array_equal(got["ids"], live["ids"])
        assert got["sum"].tobytes() == live["sum"].tobytes()  # optimizer state: float32, exact
        error = np.abs(got["values"] - live["values"])
        if encoding == "bf16":
            assert (error <= np.abs(live["values"]) * 2.0**-8).all()
        else:
            assert (error <= np.abs(live["values"]).max(axis=1, keepdims=True) / 254 * 1.0001).all()
        assert error.max() > 0
    whole = RestoreSource(cluster.whole, checkpoint_name(4)).tensor_bytes("table/t/values")
    rows = RestoreSource(cluster.whole, checkpoint_name(4)).tables["t"]["rows"]
    assert whole == rows * 4 * (2 if encoding == "bf16" else 1) + (rows * 4 if encoding == "int8" else 0)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_export_inspect_and_safetensors_read_quantized_files(tmp_path, encoding):
    cluster = quantized_cluster(tmp_path, encoding, steps=2, num_ps=1)
    url, name = cluster.chain.url, checkpoint_name(2)
    assert tools.inspect(url, name)["tables"]["t"]["encoding"] == encoding
    with safe_open(tools.export(url, name, str(tmp_path / "m.safetensors")), "np") as handle:
        exported = by_id({"ids": handle.get_tensor("embeddings/t/ids"), "values": handle.get_tensor("embeddings/t/weight")})
    (arrays, _, _), = restored(cluster.whole, name, 1)
    assert by_id(arrays)["values"].tobytes() == exported["values"].tobytes()
    with safe_open(str(cluster.whole.path(name, "shard-0.safetensors")), "pt") as handle:  # safetensors' own reader
        values = handle.get_tensor("table/t/values")
        scale = handle.get_tensor("table/t/values.scale") if encoding == "int8" else None
    assert values.dtype == (torch.bfloat16 if encoding == "bf16" else torch.int8)
    decoded = values.float() if scale is None else values.float() * scale[:, None]
    with safe_open(str(cluster.whole.path(name, "shard-0.safetensors")), "pt") as handle:
        ids = handle.get_tensor("table/t/ids").numpy()
    assert by_id({"ids": ids, "values": decoded.numpy()})["values"].tobytes() == exported["values"].tobytes()


def test_int8_keeps_a_rows_largest_value_and_a_zero_row():
    rows = np.array([[0.0, 0.0, 0.0], [1.0, -0.5, 0.25], [-3.0, 1e-9, 2.0]], np.float32)
    encoded = quantize.encode(rows, "int8")
    assert encoded["values"].tolist() == [[0, 0, 0], [127, -64, 32], [-127, 0, 85]]
    decoded = quantize.decode("int8", encoded["values"], encoded[quantize.SCALE])
    assert decoded[0].tolist() == [0.0, 0.0, 0.0] and decoded[1, 0] == 1.0 and decoded[2, 0] == -3.0
    big = quantize.encode(np.array([[3e38, -3e38]], np.float32), "bf16")["values"]
    assert quantize.bf16_finite(big)  # rounds to the largest finite bfloat16, not to an infinity


def test_an_unknown_encoding_is_refused_where_it_is_given(tmp_path):
    with pytest.raises(InvalidArgumentError, match="'fp8' is not one of none, bf16, int8"):
        ShardWrites(str(tmp_path), "fp8")


def craft(store: CheckpointStore, name: str, change) -> None:
    """Rewrite shard-0 of `name` through `change(meta, arrays)` (in place), its manifest entry to match."""
    path = store.path(name, "shard-0.safetensors")
    with open(path, "rb") as handle:
        reader = TensorReader(handle, len(open(path, "rb").read()), path)
        meta = json.loads(reader.metadata["paramserver"])
        arrays = {key: reader.read(key) for key in reader.tensors}
    change(meta, arrays)
    layout = tensor_file.plan({k: (a.dtype, a.shape) for k, a in arrays.items()}, {"paramserver": json.dumps(meta)})
    with open(path, "wb") as handle:
        handle.write(layout.header)
        for key, array in arrays.items():
            tensor_file.write_rows(handle, layout, key, 0, array)
    data = open(path, "rb").read()
    manifest = store.manifest(name)
    manifest["shards"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    with open(store.path(name, "MANIFEST.json"), "w") as handle:
        json.dump(manifest, handle)


def _set(key, value):
    def change(meta, arrays):
        arrays[key] = value(arrays[key])

    return change


def _encoding(name):
    def change(meta, arrays):
        meta["tables"]["t"]["encoding"] = name

    return change


def _drop(key):
    return lambda meta, arrays: arrays.pop(key)


CASES = {
    "unknown-encoding": ("int8", _encoding("fp8"), "metadata is malformed (tables.t.encoding"),
    "negative-scale": ("int8", _set("table/t/values.scale", lambda s: -s - 1), "holds a scale that is negative"),
    "infinite-scale": ("int8", _set("table/t/values.scale", lambda s: s + np.inf), "holds a scale that is negative"),
    "overflowing-scale": ("int8", _set("table/t/values.scale", lambda s: s + 1e37), "holds a scale that is negative"),
    "no-scale": ("int8", _drop("table/t/values.scale"), "its values.scale must be float32 of shape"),
    "short-scale": ("int8", _set("table/t/values.scale", lambda s: s[:-1]), "its values.scale must be float32"),
    "float-values-said-int8": ("int8", _set("table/t/values", lambda v: v.astype(np.float32)), "its values must be int8"),
    "bf16-said-int8": ("bf16", _encoding("int8"), "its values must be int8"),
    "bf16-infinity": ("bf16", _set("table/t/values", lambda v: v | np.uint16(0x7F80)), "holds NaN or infinite values"),
    "bf16-wrong-width": ("bf16", _set("table/t/values", lambda v: v[:, :2].copy()), "its values must be uint16 of shape"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_crafted_quantized_file_is_damaged_and_resume_falls_back(tmp_path, case, caplog):
    encoding, change, reason = CASES[case]
    cluster = quantized_cluster(tmp_path, encoding, steps=2, num_ps=1)
    crafted = checkpoint_name(2)
    craft(cluster.whole, crafted, change)
    rows = {row["name"]: row["status"] for row in tools.list_checkpoints(cluster.whole.url)}
    assert rows[checkpoint_name(1)] == "ok"
    assert rows[crafted].startswith("damaged: shard-0.safetensors") and reason in rows[crafted], rows[crafted]
    assert RestoreSource.latest(cluster.whole).name == checkpoint_name(1)
    assert reason in caplog.text


def test_the_flag_is_an_option_and_reaches_the_ps_writer(tmp_path):
    from paramserver.checkpoint import shard_writer
    from paramserver.launch import cli

    args = cli.parse_args(["node", "--role", "ps", "--checkpoint-quantize", "int8"])
    assert cli.given_options(args)["checkpoint_quantize"] == "int8"
    assert shard_writer(str(tmp_path), "int8").encoding == "int8"
