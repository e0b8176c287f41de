"""Chunk hashes: a resuming PS (RestoreSource.latest(contents=False)) checks what it reads, a chunk at
a time against the SHA-256 its file's header records, and reads no other file. A flipped byte in a
chunk it reads is refused naming the file, tensor and chunk, and nothing is restored; a flipped byte
in a chunk it does not read is another PS's to find, and `checkpoint list` (the full verdict) still
refuses it; a header changed after it was written is refused from its own digest; a file written
before chunk hashes still restores (checked whole against its manifest SHA-256 while choosing)."""

import contextlib
import hashlib
import json
import os
import random

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from paramserver.base.errors import ParamServerError
from paramserver.base.hashing import shard_of
from paramserver.checkpoint.files import chunks, shard_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointError, CheckpointStore, checkpoint_name
from paramserver.checkpoint.verdict import verdict
from paramserver.server.shard import Shard
from paramserver.tables.table_store import TableStore

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
INIT = {"kind": "normal", "std": 0.1}
ROWS = 4000  # over two shards: each file's values span about 30 chunks of 4 KiB
NAME = checkpoint_name(3)
SEED = int(os.environ.get("PS_CHUNK_SEED", "20261206"))


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_BYTES", chunks.MIN_BYTES)


def write(root: str, num_shards: int = 2) -> CheckpointStore:
    """Checkpoint NAME of a dim-16 Adagrad table "emb" of ROWS rows over `num_shards` shards."""
    store, entries = CheckpointStore(root), []
    ids = np.arange(ROWS, dtype=np.int64) * 7919
    for index in range(num_shards):
        tables = TableStore(index)
        tables.register("emb", 16, ADAGRAD, INIT, num_shards=num_shards)
        mine = ids[shard_of(ids, num_shards) == index]
        tables.lookup("emb", mine)
        grads = np.full((mine.shape[0], 16), 0.5, np.float32)
        tables.push_checked([tables.check_push("emb", mine, grads)])
        entries.append(shard_file.write(store, NAME, Shard(index, tables=tables), tables).__dict__)
    store.commit(NAME, {"step": 3, "num_shards": num_shards, "shards": entries})
    return store


def restore(store: CheckpointStore, index: int, num_shards: int) -> TableStore:
    """What a resuming PS does: choose (structure only), then fill its table as a registration does."""
    source = RestoreSource.latest(store, contents=False)
    assert source is not None and source.name == NAME
    tables = TableStore(index, restore=source)
    tables.register("emb", 16, ADAGRAD, INIT, num_shards=num_shards)
    return tables


def rows_of(tables: TableStore) -> dict[int, bytes]:
    table = tables.table("emb")
    ids, values = table.array("ids")[: table.size], table.array("values")[: table.size]
    return {int(i): v.tobytes() for i, v in zip(ids, values)}


def saved_rows(root: str, num_shards: int = 2) -> dict[int, bytes]:
    """{id: row} of the files, read by safetensors' own reader."""
    found = {}
    for index in range(num_shards):
        with safe_open(os.path.join(root, NAME, f"shard-{index}.safetensors"), "np") as handle:
            ids, values = handle.get_tensor("table/emb/ids"), handle.get_tensor("table/emb/values")
        found.update({int(i): v.tobytes() for i, v in zip(ids, values)})
    return found


def counting(store: CheckpointStore, monkeypatch) -> dict[str, int]:
    """Bytes read from each shard file through `store`, by file name."""
    counts: dict[str, int] = {}
    opened = store.open_shard

    class Counted:
        def __init__(self, handle, file):
            self.handle, self.file = handle, file

        def read(self, n=-1):
            data = self.handle.read(n)
            counts[self.file] = counts.get(self.file, 0) + len(data)
            return data

        def readinto(self, view):
            got = self.handle.readinto(view) or 0
            counts[self.file] = counts.get(self.file, 0) + got
            return got

        def __getattr__(self, name):
            return getattr(self.handle, name)

    @contextlib.contextmanager
    def open_shard(checkpoint, entry):
        with opened(checkpoint, entry) as handle:
            yield Counted(handle, entry.file)

    monkeypatch.setattr(store, "open_shard", open_shard)
    return counts


def flip(root: str, index: int, tensor: str, rng: random.Random, manifest_too: bool = True) -> int:
    """Flip a random byte of `tensor`'s data in shard file `index`; with `manifest_too`, its manifest
    entry is rewritten to match (so only the chunk hashes can find it). Returns the byte's offset in
    the tensor."""
    path = os.path.join(root, NAME, f"shard-{index}.safetensors")
    data = bytearray(open(path, "rb").read())
    length = int.from_bytes(data[:8], "little")
    lo, hi = json.loads(data[8 : 8 + length])[tensor]["data_offsets"]
    at = rng.randrange(lo, hi)
    data[8 + length + at] ^= rng.randrange(1, 256)
    with open(path, "wb") as handle:
        handle.write(data)
    if manifest_too:
        rewrite_entry(root, index, bytes(data))
    return at - lo


def rewrite_entry(root: str, index: int, data: bytes) -> None:
    path = os.path.join(root, NAME, "MANIFEST.json")
    manifest = json.load(open(path))
    entry = next(e for e in manifest["shards"] if e["index"] == index)
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    with open(path, "w") as handle:
        json.dump(manifest, handle)


def test_the_hashes_cover_every_chunk_and_safetensors_reads_the_file(tmp_path, small_chunks):
    root = str(tmp_path)
    write(root)
    path = os.path.join(root, NAME, "shard-0.safetensors")
    with safe_open(path, "np") as handle:
        record = json.loads(handle.metadata()[chunks.KEY])
        values = handle.get_tensor("table/emb/values")
    assert record["bytes"] == chunks.MIN_BYTES
    data = values.tobytes()
    want = "".join(hashlib.sha256(data[lo : lo + record["bytes"]]).hexdigest() for lo in range(0, len(data), 4096))
    assert len(data) > 8 * 4096 and record["sha256"]["table/emb/values"] == want


def test_hasher_takes_the_same_digests_whatever_the_pieces(small_chunks):
    rng = np.random.default_rng(SEED)
    data = rng.integers(0, 256, 3 * 4096 + 123, dtype=np.uint8).tobytes()
    hasher, at = chunks.Hasher({"t": len(data)}), 0
    while at < len(data):
        n = int(rng.integers(1, 9000))
        hasher.add("t", at, data[at : at + n])
        at += n
    want = "".join(hashlib.sha256(data[lo : lo + 4096]).hexdigest() for lo in range(0, len(data), 4096))
    assert hasher.missing() is None and hasher.digests("t") == want, f"seed {SEED}"
    with pytest.raises(CheckpointError, match="not in order"):
        chunks.Hasher({"t": 10}).add("t", 4, b"x")


def test_a_ps_restoring_its_own_shard_reads_its_own_file_only(tmp_path, monkeypatch, small_chunks):
    root = str(tmp_path)
    store = write(root)
    counts = counting(store, monkeypatch)
    restored = {}
    for index in range(2):
        restored.update(rows_of(restore(store, index, 2)))
        size = os.path.getsize(os.path.join(root, NAME, f"shard-{index}.safetensors"))
        other = os.path.getsize(os.path.join(root, NAME, f"shard-{1 - index}.safetensors"))
        own_read, other_read = counts.pop(f"shard-{index}.safetensors"), counts.pop(f"shard-{1 - index}.safetensors")
        assert own_read <= 1.05 * size, (own_read, size)  # its file once, and its header
        assert other_read < 0.2 * other, (other_read, other)  # the other's header only
    assert restored == saved_rows(root)


def test_a_flipped_byte_in_a_chunk_a_ps_reads_is_refused_and_restores_nothing(tmp_path, small_chunks):
    rng = random.Random(SEED)
    for tensor in ("table/emb/values", "table/emb/ids", "table/emb/sum"):
        root = str(tmp_path / tensor.replace("/", "-"))
        write(root)
        at = flip(root, 1, tensor, rng)
        source = RestoreSource.latest(CheckpointStore(root), contents=False)  # a fresh PS
        assert source is not None and source.name == NAME  # the structure holds: chosen
        tables = TableStore(1, restore=source)
        where = rf"{NAME}: shard-1.safetensors: tensor '{tensor}' does not match its SHA-256 at chunk {at // 4096}"
        with pytest.raises(CheckpointError, match=where):
            tables.register("emb", 16, ADAGRAD, INIT, num_shards=2)
        with pytest.raises(ParamServerError):  # a failed restore left no table
            tables.table("emb")


def test_a_flipped_byte_in_a_chunk_a_ps_does_not_read_is_left_to_the_full_verdict(tmp_path, small_chunks):
    rng = random.Random(SEED)
    root = str(tmp_path)
    store = write(root)
    want = saved_rows(root)
    at = flip(root, 1, "table/emb/values", rng)
    assert rows_of(restore(CheckpointStore(root), 0, 2)) == {
        i: r for i, r in want.items() if shard_of(np.array([i]), 2)[0] == 0
    }
    problem = verdict(CheckpointStore(root), NAME)
    assert (
        problem is not None and f"tensor 'table/emb/values' does not match its SHA-256 at chunk {at // 4096}" in problem
    )
    assert RestoreSource.latest(CheckpointStore(root)) is None  # the full check (export, evaluator) refuses it
    # a restore onto 3 PS reads every chunk of every file: each PS refuses it
    for index in range(3):
        with pytest.raises(CheckpointError, match="shard-1.safetensors: tensor 'table/emb/values' does not match"):
            restore(CheckpointStore(root), index, 3)
    del store


def test_a_restore_onto_more_ps_checks_every_chunk_and_restores_every_row(tmp_path, small_chunks):
    root = str(tmp_path)
    store = write(root)
    restored: dict[int, bytes] = {}
    for index in range(3):
        mine = rows_of(restore(store, index, 3))
        assert all(shard_of(np.array([i]), 3)[0] == index for i in mine)
        restored.update(mine)
    assert restored == saved_rows(root)


def test_a_header_changed_after_it_was_written_is_refused_by_its_digest(tmp_path, small_chunks):
    root = str(tmp_path)
    write(root)
    path = os.path.join(root, NAME, "shard-0.safetensors")
    data = open(path, "rb").read()
    length = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + length].decode()
    changed = header.replace('\\"steps\\": 1', '\\"steps\\": 7', 1)  # still valid metadata: another count
    assert changed != header
    data = data[:8] + changed.encode() + data[8 + length :]
    open(path, "wb").write(data)
    rewrite_entry(root, 0, data)
    with pytest.raises(CheckpointError, match="shard-0.safetensors: its header does not match its SHA-256"):
        RestoreSource(CheckpointStore(root), NAME, verify=())
    assert RestoreSource.latest(CheckpointStore(root), contents=False) is None  # skipped at the choice


def test_a_malformed_chunk_record_is_refused_at_the_choice(tmp_path):
    root = str(tmp_path)
    write(root)
    path = os.path.join(root, NAME, "shard-1.safetensors")
    with safe_open(path, "np") as handle:
        metadata = handle.metadata()
        arrays = {key: handle.get_tensor(key) for key in handle.keys()}
    for bad in ('{"bytes": 0, "sha256": {}}', '{"bytes": 4096, "sha256": {"table/emb/ids": "00"}}', "[1]"):
        save_file(arrays, path, metadata={**metadata, chunks.KEY: bad})
        rewrite_entry(root, 1, open(path, "rb").read())
        with pytest.raises(CheckpointError, match=r"shard-1.safetensors: its chunk hashes \(paramserver.chunks\)"):
            RestoreSource(CheckpointStore(root), NAME, verify=())


def test_a_file_written_before_chunk_hashes_restores_checked_whole(tmp_path, monkeypatch):
    root = str(tmp_path)
    store = write(root)
    want = saved_rows(root)
    for index in range(2):  # as an older writer wrote them: no chunk record
        path = os.path.join(root, NAME, f"shard-{index}.safetensors")
        with safe_open(path, "np") as handle:
            metadata = {k: v for k, v in handle.metadata().items() if k != chunks.KEY}
            arrays = {key: handle.get_tensor(key) for key in handle.keys()}
        save_file(arrays, path, metadata=metadata)
        rewrite_entry(root, index, open(path, "rb").read())
    store = CheckpointStore(root)
    restored = {}
    for index in range(2):
        restored.update(rows_of(restore(store, index, 2)))
    assert restored == want
    flip(root, 0, "table/emb/values", random.Random(SEED), manifest_too=False)
    assert RestoreSource.latest(CheckpointStore(root), contents=False) is None  # refused while choosing, as before
    with pytest.raises(CheckpointError, match="shard-0.safetensors does not match its SHA-256"):
        RestoreSource(CheckpointStore(root), NAME, verify=(), by_chunk=True)
