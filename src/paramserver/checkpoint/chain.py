"""A checkpoint's chain: the checkpoints its shard files are deltas on, each opened and checked.

An incremental checkpoint's shard file is a delta on the same shard's file of an earlier
checkpoint, its parent (shard_file.py): the rows changed since, and the ids evicted since. A
shard file's chain is that file, its parent's file, and so on back to a whole file (its base).
A `Link` is one checkpoint of a chain: its manifest and every shard file's header, checked as a
RestoreSource checks them (the header and metadata schema when opened; the SHA-256 and
finiteness of the files in `verify` then, of the others on first read).

Rows of a chain, in bounded memory (what the chain rule of worker/checkpoints.py bounds: the
deltas' ids): `apply_chain` writes base then each delta into a table (deleted ids removed, rows
overwritten in place or added at the end, so the table's row order is the one a whole checkpoint
would give); `current_slices` streams the rows that are current at the newest link, for readers
without a table (export, the evaluator): a row of link k is current when no later delta names
its id (as a row, or as deleted).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base import kernels
from ..base.hashing import shard_of
from . import quantize, shard_meta, tensor_file
from .shard_file import META_KEY
from .store import MANIFEST, MAX_CHAIN, CheckpointError, CheckpointStore, ShardFile, os_reason
from .tensor_file import TensorReader, TensorSpec

SLICE_BYTES = 8 << 20  # bytes of rows read at a time


@dataclass
class SavedFile:
    """One shard file of one checkpoint: its manifest entry, validated metadata and tensors."""

    link: Link
    entry: ShardFile
    meta: dict[str, Any]
    tensors: dict[str, TensorSpec]

    @property
    def where(self) -> str:
        return f"checkpoint {self.link.name}: {self.entry.file}"

    def reader(self) -> contextlib.AbstractContextManager[TensorReader]:
        return self.link.reader(self.entry.index)


class Link:
    """One checkpoint: its manifest and shard files (see the module docstring)."""

    def __init__(self, store: CheckpointStore, name: str, verify: Iterable[int] | None, allow_non_finite: bool):
        self.store, self.name, self.allow_non_finite = store, name, allow_non_finite
        self.manifest = store.manifest(name)
        self.step = self.manifest.get("step", 0)
        if type(self.step) is not int or self.step < 0:
            raise CheckpointError(f"checkpoint {name}: {MANIFEST} has step {str(self.step)[:40]!r}, not a count")
        entries = store.shard_files(name, self.manifest)
        wanted = {entry.index for entry in entries} if verify is None else set(verify)
        self.verified: set[int] = set()
        self._lock = threading.Lock()  # one scan of a file at a time (readers on several threads)
        self.files: dict[int, SavedFile] = {}
        for entry in entries:
            store.check_size(name, entry)
            self.files[entry.index] = self._header(entry)
            if entry.index in wanted:
                self.scan(entry.index)

    @property
    def num_shards(self) -> int:
        return len(self.files)

    def _header(self, entry: ShardFile) -> SavedFile:
        where = f"checkpoint {self.name}: {entry.file}"
        try:
            with self.store.open_shard(self.name, entry) as handle:
                reader = TensorReader(handle, entry.bytes, where)
            meta = shard_meta.parse(reader.metadata.get(META_KEY), reader.tensors, where)
        except CheckpointError:
            self.store.verify_file(self.name, entry)  # a file changed since it was written says so first
            raise
        if (meta.get("parent") or "") != entry.parent:
            raise CheckpointError(
                f"{where}: the file is a delta on {meta.get('parent') or 'nothing'}, its manifest entry says "
                f"{entry.parent or 'nothing'}"
            )
        return SavedFile(self, entry, meta, reader.tensors)

    def scan(self, index: int) -> None:
        """One pass over shard file `index` (once): its SHA-256 against the manifest, and every
        floating-point value finite (unless allowed otherwise)."""
        if index in self.verified:
            return
        saved = self.files[index]
        entry, where = saved.entry, saved.where
        digest, size, problem = hashlib.sha256(), 0, None
        with self.store.open_shard(self.name, entry) as handle:
            try:
                for tensor, data in tensor_file.scan(handle, entry.bytes, saved.tensors, SLICE_BYTES, where):
                    digest.update(data)
                    size += len(data)
                    if tensor is not None and problem is None:
                        problem = self._values_problem(saved, tensor, data)
            except OSError as exc:
                raise CheckpointError(f"{where}: cannot read it: {os_reason(exc)}") from exc
        self.store.check_digest(self.name, entry, size, digest.hexdigest())
        if problem is not None:
            raise CheckpointError(f"{where}: {problem}")
        self.verified.add(index)

    def _values_problem(self, saved: SavedFile, tensor: str, data: bytes) -> str | None:
        """What is wrong with a piece of `tensor`'s values: a NaN or infinity in a floating-point
        (or bfloat16) tensor, unless allowed; an int8 encoding's scale out of its range, always."""
        dtype = saved.tensors[tensor].dtype
        array = np.frombuffer(data, dtype)
        if tensor.endswith("/" + quantize.SCALE) and not quantize.scales_in_range(array):
            return f"tensor {tensor!r} holds a scale that is negative, not finite or above {quantize.MAX_SCALE:.4g}"
        if self.allow_non_finite:
            return None
        if dtype.kind == "f":
            finite = kernels.all_finite(array)
        else:
            finite = dtype != quantize.BF16_BITS or quantize.bf16_finite(array)
        return None if finite else f"tensor {tensor!r} holds NaN or infinite values"

    @contextlib.contextmanager
    def reader(self, index: int) -> Iterator[TensorReader]:
        """A reader of shard file `index`, scanned first if it was not yet (the caller serializes scans)."""
        saved = self.files[index]
        with self._lock:
            self.scan(index)
        with self.store.open_shard(self.name, saved.entry) as handle:
            yield TensorReader(handle, saved.entry.bytes, saved.where)


def file_chain(newest: Link, index: int, link: Any) -> list[SavedFile]:
    """Shard file `index`'s chain, base first: `link(name)` opens (or finds) a parent checkpoint."""
    files = [newest.files[index]]
    while parent := files[-1].entry.parent:
        if len(files) >= MAX_CHAIN:
            raise CheckpointError(f"checkpoint {newest.name}: a chain of more than {MAX_CHAIN} checkpoints")
        older = link(parent)
        if older.num_shards != newest.num_shards:
            raise CheckpointError(
                f"checkpoint {files[-1].link.name}: a delta on {parent}, which has {older.num_shards} shards, "
                f"not {newest.num_shards}"
            )
        files.append(older.files[index])
    return files[::-1]


def file_slices(
    saved: SavedFile, table: str, names: Iterable[str], shard: int = 0, num_shards: int = 1
) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """(ids, {array name: rows}) of the rows of `table` in one file that belong to `shard` of
    `num_shards`, a slice at a time (the file is checked whole first); values as float32 whatever
    their encoding (quantize.py)."""
    encoding = saved.meta["tables"][table].get("encoding", "float32")
    names = list(names)
    if encoding == "int8" and "values" in names:
        names.append(quantize.SCALE)
    with saved.reader() as reader:
        rows = _ids_spec(reader, table).shape[0]
        specs = {name: _row_spec(reader, table, name, rows) for name in names}
        step = max(1, SLICE_BYTES // max(1, 8 + sum(spec.row_bytes for spec in specs.values())))
        for lo in range(0, rows, step):
            ids = reader.read(f"table/{table}/ids", lo, lo + step)
            mine = shard_of(ids, num_shards) == shard if num_shards > 1 else np.ones(ids.shape[0], bool)
            if not mine.any():
                continue
            arrays = {name: reader.read(f"table/{table}/{name}", lo, lo + step)[mine] for name in specs}
            if "values" in arrays and encoding != "float32":
                arrays["values"] = quantize.decode(encoding, arrays["values"], arrays.pop(quantize.SCALE, None))
            yield ids[mine], arrays


def deleted_ids(saved: SavedFile, table: str, shard: int = 0, num_shards: int = 1) -> np.ndarray:
    """The ids a delta's table had evicted since its parent (those of `shard` of `num_shards`)."""
    with saved.reader() as reader:
        ids = reader.read(f"table/{table}/deleted")
    return ids[shard_of(ids, num_shards) == shard] if num_shards > 1 else ids


def apply_chain(chain: list[SavedFile], table: Any, names: list[str], shard: int, num_shards: int) -> None:
    """Write a shard file's chain of rows of `table` into it (an EmbeddingTable: `delete_ids`,
    `load_rows(..., overwrite=True)`): the base's rows, then each delta's deletions and rows."""
    for k, saved in enumerate(chain):
        if table.name not in saved.meta["tables"]:
            continue
        if k > 0:
            table.delete_ids(deleted_ids(saved, table.name, shard, num_shards))
        for ids, arrays in file_slices(saved, table.name, names, shard, num_shards):
            table.load_rows(ids, arrays, overwrite=k > 0)


def current_slices(
    chain: list[SavedFile], table: str, names: list[str], shard: int = 0, num_shards: int = 1, first: int = 0
) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """The rows of `table` current at the chain's newest link, a slice at a time: each link's
    rows that no later delta names (by row or by deletion); only those of links `first`.. (1: the
    rows written after the chain's first link, for a delta export)."""
    newest_ids, newest_code = _newest_mentions(chain, table)
    for k, saved in enumerate(chain):
        if k < first or table not in saved.meta["tables"]:
            continue
        for ids, arrays in file_slices(saved, table, names, shard, num_shards):
            if newest_ids.shape[0]:
                at = np.minimum(np.searchsorted(newest_ids, ids), newest_ids.shape[0] - 1)
                keep = np.where(newest_ids[at] == ids, newest_code[at] == 2 * k + 1, k == 0)
            else:
                keep = np.full(ids.shape[0], k == 0)
            if keep.any():
                yield ids[keep], {name: array[keep] for name, array in arrays.items()}


def deleted_since_first(chain: list[SavedFile], table: str) -> np.ndarray:
    """The ids the deltas of `chain` deleted that no later delta brought back (sorted): what was
    evicted after its first link, and is not a row at its newest."""
    ids, codes = _newest_mentions(chain, table)
    return ids[codes % 2 == 0]


def _newest_mentions(chain: list[SavedFile], table: str) -> tuple[np.ndarray, np.ndarray]:
    """Every id the deltas of `chain` name, sorted, with the newest mention's code: 2k for a
    deletion in link k, 2k + 1 for a row (a delta's rows come after its deletions)."""
    ids, codes = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for k, saved in enumerate(chain[1:], start=1):
        if table not in saved.meta["tables"]:
            continue
        deleted = deleted_ids(saved, table)
        ids.append(deleted)
        codes.append(np.full(deleted.shape[0], 2 * k, np.int64))
        for rows, _ in file_slices(saved, table, []):
            ids.append(rows)
            codes.append(np.full(rows.shape[0], 2 * k + 1, np.int64))
    all_ids, all_codes = np.concatenate(ids), np.concatenate(codes)
    order = np.lexsort((all_codes, all_ids))  # by id, then code: each id's newest mention last
    all_ids, all_codes = all_ids[order], all_codes[order]
    last = np.ones(all_ids.shape[0], bool)
    last[:-1] = all_ids[1:] != all_ids[:-1]
    return all_ids[last], all_codes[last]


def _ids_spec(reader: TensorReader, table: str) -> TensorSpec:
    spec = reader.tensors[f"table/{table}/ids"]
    if spec.dtype != np.int64 or len(spec.shape) != 1:
        raise CheckpointError(f"{reader.where}: table {table!r} ids are not a 1-D int64 tensor")
    return spec


def _row_spec(reader: TensorReader, table: str, name: str, rows: int) -> TensorSpec:
    spec = reader.tensors.get(f"table/{table}/{name}")
    if spec is None or not spec.shape or spec.shape[0] != rows:
        raise CheckpointError(f"{reader.where}: table {table!r} has no {name} for each of its {rows} rows")
    return spec
