"""Safetensors files written a slice at a time and read back in pieces; nothing in one is trusted:
a malformed header is a clear error before anything is allocated for it, and a crafted checkpoint
(an id twice, NaN rows, arrays that do not match the ids) is refused naming the file."""

import io
import json

import numpy as np
import pytest
from safetensors import numpy as safetensors_numpy

from paramserver.checkpoint.files import shard_file, tensor_file
from paramserver.checkpoint.files.tensor_file import TensorFileError, TensorReader
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointError, CheckpointStore
from paramserver.server.shard import Shard
from paramserver.tables.table_store import TableStore

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}


def test_a_file_written_in_slices_out_of_order_is_what_safetensors_reads():
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(6, 2), "b": np.arange(5, dtype=np.int64), "c": np.zeros((0, 3), np.float32)}
    layout = tensor_file.plan({k: (v.dtype, v.shape) for k, v in arrays.items()}, {"x": "y"})
    handle = io.BytesIO()
    handle.write(layout.header)
    for lo in (4, 0, 2):  # slices in any order
        tensor_file.write_rows(handle, layout, "a", lo, arrays["a"][lo : lo + 2])
    tensor_file.write_rows(handle, layout, "b", 0, arrays["b"])
    data = handle.getvalue()
    assert len(data) == layout.size
    loaded = safetensors_numpy.load(data)
    for key, value in arrays.items():
        np.testing.assert_array_equal(loaded[key], value)
    reader = TensorReader(io.BytesIO(data), len(data), "f")
    np.testing.assert_array_equal(reader.read("a", 1, 4), arrays["a"][1:4])
    assert reader.metadata == {"x": "y"}


def header(body: bytes, data: bytes = b"") -> bytes:
    return len(body).to_bytes(8, "little") + body + data


@pytest.mark.parametrize("data, fragment", [
    (b"\x01\x02", "not a safetensors file"),
    ((1 << 40).to_bytes(8, "little") + b"{}", "header of 1099511627776 bytes does not fit"),
    (header(b"{not json"), "header is not JSON"),
    (header(b"[1, 2]"), "not a JSON object"),
    (header(json.dumps({"t": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]}}).encode(), b"\0" * 8),
     "does not match its range"),
    (header(json.dumps({"t": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}).encode(), b"\0" * 4),
     "malformed entry"),
    (header(json.dumps({"t": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}).encode(), b"\0" * 4),
     "malformed entry"),
    (header(json.dumps({"__metadata__": {"a": 1}}).encode()), "not a map of strings"),
])
def test_a_malformed_header_is_a_clear_error(data, fragment):
    with pytest.raises(TensorFileError, match=fragment):
        TensorReader(io.BytesIO(data), len(data), "shard-0.safetensors")


def crafted(tmp_path, ids, values):
    """A one-shard checkpoint of table t (dim 2) whose rows are given as they are."""
    tables = TableStore(0)
    tables.register("t", 2, ADAGRAD, {"kind": "zeros"})
    real = CheckpointStore(str(tmp_path / "real"))
    entry = shard_file.write(real, "ckpt-000000001", Shard(0, tables=tables), tables)
    path = tmp_path / "real" / "ckpt-000000001" / entry.file
    with open(path, "rb") as handle:
        meta = TensorReader(handle, entry.bytes, str(path)).metadata
    saved = json.loads(meta["paramserver"])
    del saved["tables"]["t"]["rows"]  # the crafted rows are another number (a file may leave it out)
    meta = {"paramserver": json.dumps(saved)}  # no chunk hashes (as an older file): its structure is checked
    arrays = {"table/t/ids": ids, "table/t/values": values, "table/t/sum": np.zeros_like(values)}
    store = CheckpointStore(str(tmp_path / "crafted"))
    entry = store.write_shard("ckpt-000000001", 0, safetensors_numpy.save(arrays, metadata=meta))
    store.commit("ckpt-000000001", {"step": 1, "num_shards": 1, "shards": [entry.__dict__]})
    return RestoreSource(store, "ckpt-000000001")


@pytest.mark.parametrize("ids, values, fragment", [
    (np.array([1, 1, 2], np.int64), np.zeros((3, 2), np.float32), "table 't' holds id 1 twice"),
    (np.array([1, 2, 3], np.int64), np.zeros((2, 2), np.float32), r"shard-0\.safetensors: table 't' holds 3 ids and"),
    (np.array([1, 2, 3], np.int64), np.zeros((3, 5), np.float32), r"shard-0\.safetensors: .*not float32 rows of"),
])
def test_a_crafted_table_is_refused_naming_it_before_any_table_is_filled(tmp_path, ids, values, fragment):
    with pytest.raises(CheckpointError, match=rf"ckpt-000000001: {fragment}"):
        crafted(tmp_path, ids, values)  # refused when opened: resume chooses the checkpoint before it


@pytest.mark.parametrize("file, fragment", [
    ("/dev/zero", "names '/dev/zero'"),
    ("../../shard-0.safetensors", "names '../../shard-0.safetensors'"),
    ("shard-1.safetensors", "not shard-0.safetensors"),
])
def test_a_manifest_naming_a_file_that_is_not_its_shards_own_is_refused(tmp_path, file, fragment):
    source = crafted(tmp_path, np.array([1, 2], np.int64), np.zeros((2, 2), np.float32))
    path = tmp_path / "crafted" / source.name / "MANIFEST.json"
    manifest = json.loads(path.read_text())
    manifest["shards"][0].update(file=file, bytes=1 << 40)
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=fragment):
        RestoreSource(source.store, source.name)
    assert RestoreSource.latest(source.store) is None
