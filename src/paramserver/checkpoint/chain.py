"""A checkpoint's chain: the checkpoints its shard files are deltas on, each opened and checked.

An incremental checkpoint's shard file is a delta on the same shard's file of an earlier
checkpoint, its parent (shard_file.py): the rows changed since, and the ids evicted since. A
shard file's chain is that file, its parent's file, and so on back to a whole file (its base).
A `Link` is one checkpoint of a chain: its manifest and every shard file's header, checked as a
RestoreSource checks them (the header and metadata schema when opened; the SHA-256 and
finiteness of the files in `verify` then, of the others on first read).

Rows of a chain, in bounded memory (what the chain rule of worker/recovery/checkpoints.py bounds: the
deltas' ids): `apply_chain` writes base then each delta into a table (deleted ids removed, rows
overwritten in place or added at the end, so the table's row order is the one a whole checkpoint
would give); `current_slices` streams the rows that are current at the newest link, for readers
without a table (export, the evaluator): a row of link k is current when no later delta names
its id (as a row, or as deleted).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from paramserver.base.hashing import mix64
from paramserver.checkpoint.files import chunks, quantize, shard_meta, tensor_file, values
from paramserver.checkpoint.files.shard_file import META_KEY
from paramserver.checkpoint.files.tensor_file import TensorReader, TensorSpec
from paramserver.checkpoint.store import MANIFEST, MAX_CHAIN, CheckpointError, CheckpointStore, ShardFile, os_reason

SLICE_BYTES = 8 << 20  # bytes of rows read at a time
MENTIONS_PER_PASS = 2 << 20  # ids the deltas of a chain name held at once (about 24 bytes each)
UNIQUE_PER_PASS = 4 << 20  # ids held (and sorted) at once to find one named twice


@dataclass
class SavedFile:
    """One shard file of one checkpoint: its manifest entry, validated metadata and tensors."""

    link: Link
    entry: ShardFile
    meta: dict[str, Any]
    tensors: dict[str, TensorSpec]
    chunks: chunks.Chunks | None = None  # its chunk hashes (None: a file written before them)

    @property
    def where(self) -> str:
        return f"checkpoint {self.link.name}: {self.entry.file}"

    def reader(self) -> contextlib.AbstractContextManager[TensorReader]:
        return self.link.reader(self.entry.index)


class Link:
    """One checkpoint: its manifest and shard files (see the module docstring)."""

    def __init__(
        self,
        store: CheckpointStore,
        name: str,
        verify: Iterable[int] | None,
        allow_non_finite: bool,
        manifest: dict[str, Any] | None = None,
        by_chunk: bool = False,
    ):
        """`by_chunk`: a file without chunk hashes is scanned when opened, as if `verify` named it.
        `manifest`: the checkpoint's manifest in memory (one not yet committed), else read. Its
        SHA-256s are the ones the writers took from the bytes they had just written (read back
        after fsync): its files are checked whole, every check but hashing them again (half of
        the cost); every other link is hashed."""
        self.store, self.name, self.allow_non_finite = store, name, allow_non_finite
        self.hashed = manifest is None
        self.manifest = store.manifest(name) if manifest is None else store.check_manifest(name, manifest)
        self.step = self.manifest.get("step", 0)
        if type(self.step) is not int or self.step < 0:
            raise CheckpointError(f"checkpoint {name}: {MANIFEST} has step {str(self.step)[:40]!r}, not a count")
        entries = store.shard_files(name, self.manifest)
        # a checkpoint this store saw pass whole (same files) is not read again: files never change
        self.trusted = store.passed(name, self.manifest)
        wanted = {entry.index for entry in entries} if verify is None else set(verify)
        self.verified: set[int] = {entry.index for entry in entries} if self.trusted else set()
        self.whole = verify is None  # every file checked whole when opened, every table's ids with them
        self._lock = threading.Lock()  # one scan of a file at a time (readers on several threads)
        self.files: dict[int, SavedFile] = {}
        for entry in entries:
            store.check_size(name, entry)
            self.files[entry.index] = self._header(entry)
            if entry.index in wanted or (by_chunk and self.files[entry.index].chunks is None):
                self.scan(entry.index)
        if verify is None and not self.trusted:
            for table in sorted({table for saved in self.files.values() for table in saved.meta["tables"]}):
                self._check_unique(table)

    def _check_unique(self, table: str) -> None:
        """No id of `table` twice in this checkpoint (in one file or in two), in bounded memory: a
        hash partition of the ids at a time (UNIQUE_PER_PASS ids held, sorted in place); and each
        in the shard file of its shard."""
        holding = [saved for saved in self.files.values() if table in saved.meta["tables"]]
        total = sum(saved.tensors[f"table/{table}/ids"].shape[0] for saved in holding)
        parts = _partitions(total, UNIQUE_PER_PASS)
        for part in range(parts):
            found = [np.zeros(0, np.int64)]
            for saved in holding:
                with self.reader(saved.entry.index) as reader:
                    for ids in _id_slices(reader, f"table/{table}/ids"):
                        hashed = mix64(ids)
                        if part == 0:
                            self.check_route(saved, table, ids, hashed)
                        found.append(ids[_part_of_hash(hashed, parts) == np.uint64(part)] if parts > 1 else ids)
            if part == 0 and self.num_shards > 1:  # a delta's deleted ids are its shard's too
                for saved in holding:
                    if f"table/{table}/deleted" in saved.tensors:
                        with self.reader(saved.entry.index) as reader:
                            for gone in _id_slices(reader, f"table/{table}/deleted"):
                                self.check_route(saved, table, gone, mix64(gone))
            ids = np.concatenate(found)
            del found
            if ids.shape[0] > 2 * UNIQUE_PER_PASS + 4096:  # hashes far from even: crafted, not written
                raise CheckpointError(f"checkpoint {self.name}: table {table!r} holds ids crafted to collide")
            ids.sort()
            twice = np.flatnonzero(ids[1:] == ids[:-1])
            if twice.shape[0]:
                raise CheckpointError(f"checkpoint {self.name}: table {table!r} holds id {int(ids[twice[0]])} twice")

    def check_route(self, saved: SavedFile, table: str, ids: np.ndarray, hashed: np.ndarray) -> None:
        """Every id of shard file i is shard i's (`shard_of`): a restore onto as many shards reads
        each shard's own file and keeps its ids only, so another's row would be lost unseen."""
        if self.num_shards < 2:
            return
        other = np.flatnonzero(hashed % np.uint64(self.num_shards) != np.uint64(saved.entry.index))
        if other.shape[0]:
            raise CheckpointError(
                f"{saved.where}: table {table!r} holds id {int(ids[other[0]])}, which belongs to shard "
                f"{int(hashed[other[0]] % np.uint64(self.num_shards))} of {self.num_shards}"
            )

    @property
    def num_shards(self) -> int:
        return len(self.files)

    def _header(self, entry: ShardFile) -> SavedFile:
        where = f"checkpoint {self.name}: {entry.file}"
        try:
            with self.store.open_shard(self.name, entry) as handle:
                reader = TensorReader(handle, entry.bytes, where)
            meta = shard_meta.parse(reader.metadata.get(META_KEY), reader.tensors, where)
            hashes = chunks.parse(reader.metadata.get(chunks.KEY), reader.metadata.get(META_KEY), reader.tensors, where)
        except CheckpointError:
            self.store.verify_file(self.name, entry)  # a file changed since it was written says so first
            raise
        if (meta.get("parent") or "") != entry.parent:
            raise CheckpointError(
                f"{where}: the file is a delta on {meta.get('parent') or 'nothing'}, its manifest entry says "
                f"{entry.parent or 'nothing'}"
            )
        return SavedFile(self, entry, meta, reader.tensors, hashes)

    def scan(self, index: int) -> None:
        """One pass over shard file `index` (once): its SHA-256 against the manifest, its chunk
        hashes (when it has them) against its header, and every floating-point value finite
        (unless allowed otherwise)."""
        if index in self.verified:
            return
        saved = self.files[index]
        entry, where = saved.entry, saved.where
        digest, size, problem = hashlib.sha256() if self.hashed else None, 0, None
        sizes = {name: spec.nbytes for name, spec in saved.tensors.items()}
        hashes = chunks.Hasher(sizes, saved.chunks.chunk) if saved.chunks is not None else None
        with self.store.open_shard(self.name, entry) as handle:
            try:
                for tensor, data in tensor_file.scan(handle, entry.bytes, saved.tensors, SLICE_BYTES, where):
                    if digest is not None:
                        digest.update(data)
                    if tensor is not None and hashes is not None:
                        hashes.add(tensor, hashes.done(tensor), data)
                    size += len(data)
                    if tensor is not None and problem is None:
                        problem = self._values_problem(saved, tensor, data)
            except OSError as exc:
                raise CheckpointError(f"{where}: cannot read it: {os_reason(exc)}") from exc
        self.store.check_digest(self.name, entry, size, digest.hexdigest() if digest is not None else None)
        if saved.chunks is not None and hashes is not None:
            saved.chunks.check_pass(hashes, saved.tensors, where)
        if problem is not None:
            raise CheckpointError(f"{where}: {problem}")
        self.verified.add(index)

    def _values_problem(self, saved: SavedFile, tensor: str, data: bytes) -> str | None:
        """What is wrong with a piece of `tensor`'s values (values.py: the writer's own checks)."""
        return values.problem(tensor, np.frombuffer(data, saved.tensors[tensor].dtype), self.allow_non_finite)

    @contextlib.contextmanager
    def reader(self, index: int) -> Iterator[TensorReader]:
        """A reader of shard file `index`: of a file with chunk hashes not checked whole yet, one
        that checks each chunk it reads (chunks.py); of any other, scanned whole first if it was
        not yet (the caller serializes scans)."""
        saved = self.files[index]
        chunked = saved.chunks is not None and index not in self.verified
        if not chunked:
            with self._lock:
                self.scan(index)
        with self.store.open_shard(self.name, saved.entry) as handle:  # its header parsed once, when opened
            if saved.chunks is not None and chunked:
                yield chunks.ChunkedReader(
                    handle, saved.entry.bytes, saved.where, saved.tensors, saved.chunks, self.allow_non_finite
                )
            else:
                yield TensorReader(handle, saved.entry.bytes, saved.where, saved.tensors)


def file_chain(newest: Link, index: int, link: Any) -> list[SavedFile]:
    """Shard file `index`'s chain, base first: `link(name)` opens (or finds) a parent checkpoint.
    Every link of a table holds it with the newest's dim and optimizer, and the row tensors the
    newest holds (a delta is applied row by row onto its parent's rows)."""
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
    for table, meta in files[0].meta["tables"].items():
        names = _row_names(files[0], table)
        for saved in files[1:]:
            held = saved.meta["tables"].get(table)
            if held is None:
                continue
            if (held["dim"], held["spec"]) != (meta["dim"], meta["spec"]) or not names <= _row_names(saved, table):
                raise CheckpointError(
                    f"checkpoint {newest.name}: {files[0].entry.file} is a delta on {saved.link.name}, whose table "
                    f"{table!r} has dim {held['dim']} and optimizer {held['spec']} (or other row tensors), "
                    f"not dim {meta['dim']} and {meta['spec']}"
                )
    return files[::-1]


def _row_names(saved: SavedFile, table: str) -> set[str]:
    """The row tensors a file holds for `table` (its values in any encoding as "values")."""
    prefix = f"table/{table}/"
    names = {key[len(prefix) :] for key in saved.tensors if key.startswith(prefix) and "/" not in key[len(prefix) :]}
    return names - {"ids", "deleted", quantize.SCALE}


def check_rows(chain: list[SavedFile], table: str) -> None:
    """The rows current at the chain's newest link are as many as its metadata says (a whole
    file's are its ids, checked with its header): counted in bounded memory (`current_slices`)."""
    newest = chain[-1]
    if len(chain) == 1 or table not in newest.meta["tables"]:
        return
    said = newest.meta["tables"][table].get("rows")
    if said is None:
        return
    count = sum(ids.shape[0] for ids, _ in current_slices(chain, table, []))
    if count != said:
        raise CheckpointError(f"{newest.where}: table {table!r} says {said} rows and its chain holds {count}")


def file_slices(
    saved: SavedFile,
    table: str,
    names: Iterable[str],
    shard: int = 0,
    num_shards: int = 1,
    part: int = 0,
    parts: int = 1,
) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """(ids, {array name: rows}) of the rows of `table` in one file that belong to `shard` of
    `num_shards` (and hash partition `part` of `parts`), a slice at a time (the file is checked
    whole first); values as float32 whatever their encoding (quantize.py)."""
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
            mine = _mine(ids, shard, num_shards, part, parts, _routed(saved, table))
            if mine is not None and not mine.any():
                continue
            arrays = {name: reader.read(f"table/{table}/{name}", lo, lo + step) for name in specs}
            if mine is not None:
                ids, arrays = ids[mine], {name: array[mine] for name, array in arrays.items()}
            if "values" in arrays and encoding != "float32":
                arrays["values"] = quantize.decode(encoding, arrays["values"], arrays.pop(quantize.SCALE, None))
            yield ids, arrays


def deleted_ids(
    saved: SavedFile, table: str, shard: int = 0, num_shards: int = 1, part: int = 0, parts: int = 1
) -> Iterator[np.ndarray]:
    """The ids a delta's table had evicted since its parent (those of `shard` of `num_shards`, and
    of hash partition `part` of `parts`), a slice at a time: a file says how many, and may lie."""
    with saved.reader() as reader:
        for ids in _id_slices(reader, f"table/{table}/deleted"):
            mine = _mine(ids, shard, num_shards, part, parts, _routed(saved, table))
            yield ids if mine is None else ids[mine]


def apply_chain(chain: list[SavedFile], table: Any, names: list[str], shard: int, num_shards: int) -> None:
    """Write a shard file's chain of rows of `table` into it (an EmbeddingTable: `delete_ids`,
    `load_rows(..., overwrite=True)`): the base's rows, then each delta's deletions and rows."""
    for k, saved in enumerate(chain):
        if table.name not in saved.meta["tables"]:
            continue
        if k > 0:
            for ids in deleted_ids(saved, table.name, shard, num_shards):
                table.delete_ids(ids)
        for ids, arrays in file_slices(saved, table.name, names, shard, num_shards):
            table.load_rows(ids, arrays, overwrite=k > 0)


def current_slices(
    chain: list[SavedFile], table: str, names: list[str], shard: int = 0, num_shards: int = 1, first: int = 0
) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """The rows of `table` current at the chain's newest link, a slice at a time: each link's
    rows that no later delta names (by row or by deletion); only those of links `first`.. (1: the
    rows written after the chain's first link, for a delta export). Memory: the ids the deltas
    name, MENTIONS_PER_PASS at a time (more: a hash partition of them per pass, each pass over
    the chain's rows again)."""
    parts = _passes(chain, table)
    for part in range(parts):
        newest_ids, newest_code = _newest_mentions(chain, table, part, parts)
        for k, saved in enumerate(chain):
            if k < first or table not in saved.meta["tables"]:
                continue
            for ids, arrays in file_slices(saved, table, names, shard, num_shards, part, parts):
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
    found = []
    for part in range(parts := _passes(chain, table)):
        ids, codes = _newest_mentions(chain, table, part, parts)
        found.append(ids[codes % 2 == 0])
    return np.sort(np.concatenate(found)) if parts > 1 else found[0]


def _passes(chain: list[SavedFile], table: str) -> int:
    """Hash partitions of the ids the deltas of `chain` name (from the headers), MENTIONS_PER_PASS each."""
    named = sum(
        saved.tensors[f"table/{table}/{name}"].shape[0]
        for saved in chain[1:]
        if table in saved.meta["tables"]
        for name in ("ids", "deleted")
    )
    return _partitions(named, MENTIONS_PER_PASS)


def _newest_mentions(chain: list[SavedFile], table: str, part: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """Every id of hash partition `part` of `parts` the deltas of `chain` name, sorted, with the
    newest mention's code: 2k for a deletion in link k, 2k + 1 for a row (a delta's rows come
    after its deletions)."""
    ids, codes = [np.zeros(0, np.int64)], [np.zeros(0, np.uint16)]
    held = 0
    for k, saved in enumerate(chain[1:], start=1):
        if table not in saved.meta["tables"]:
            continue
        deleted = ((found, 2 * k) for found in deleted_ids(saved, table, part=part, parts=parts))
        rows = ((found, 2 * k + 1) for found, _ in file_slices(saved, table, [], 0, 1, part, parts))
        for found, code in itertools.chain(deleted, rows):
            held += found.shape[0]
            if held > 2 * MENTIONS_PER_PASS + 4096:  # hashes far from even: ids crafted to collide
                raise CheckpointError(f"{saved.where}: table {table!r} names ids crafted to collide")
            ids.append(found)
            codes.append(np.full(found.shape[0], code, np.uint16))
    all_ids, all_codes = np.concatenate(ids), np.concatenate(codes)
    del ids, codes
    order = np.argsort(all_ids, kind="stable")  # by id; each id's mentions stay in link order, newest last
    all_ids, all_codes = all_ids[order], all_codes[order]
    del order
    last = np.ones(all_ids.shape[0], bool)
    last[:-1] = all_ids[1:] != all_ids[:-1]
    return all_ids[last], all_codes[last]


def _routed(saved: SavedFile, table: str) -> tuple[SavedFile, str] | None:
    """(file, table) whose ids are to be checked as they are read to be its shard's: a file of a
    checkpoint of several shards not checked whole when opened (then `_check_unique` did it)."""
    return None if saved.link.whole or saved.link.num_shards < 2 else (saved, table)


def _mine(
    ids: np.ndarray, shard: int, num_shards: int, part: int, parts: int, routed: tuple[SavedFile, str] | None = None
) -> np.ndarray | None:
    """Which of `ids` belong to `shard` of `num_shards` and hash partition `part` of `parts` (None:
    all). `routed`: the (file, table) they were read from, whose shard each must be."""
    if num_shards == 1 and parts == 1 and routed is None:
        return None
    hashed = mix64(ids)
    if routed is not None:
        routed[0].link.check_route(routed[0], routed[1], ids, hashed)
        if num_shards == 1 and parts == 1:
            return None
    mine = hashed % np.uint64(num_shards) == shard if num_shards > 1 else None  # shard_of's rule
    if parts > 1:
        in_part = _part_of_hash(hashed, parts) == part
        mine = in_part if mine is None else mine & in_part
    return mine


def _part_of(ids: np.ndarray, parts: int) -> np.ndarray:
    """Each id's hash partition of `parts` (a power of two)."""
    return _part_of_hash(mix64(ids), parts)


def _part_of_hash(hashed: np.ndarray, parts: int) -> np.ndarray:
    """The partition of `parts` (a power of two) of each hash: its high bits (its low ones choose
    the shard, as `shard_of` takes it modulo the shard count)."""
    return hashed >> np.uint64(64 - (parts.bit_length() - 1))


def _partitions(count: int, per_pass: int) -> int:
    """The power of two of hash partitions that holds `count` ids about `per_pass` at a time."""
    return 1 if count <= per_pass else 1 << (-(-count // per_pass) - 1).bit_length()


def _id_slices(reader: TensorReader, name: str) -> Iterator[np.ndarray]:
    """A 1-D int64 tensor of ids, SLICE_BYTES at a time."""
    rows = reader.tensors[name].shape[0]
    step = SLICE_BYTES // 8
    for lo in range(0, rows, step):
        yield reader.read(name, lo, lo + step)


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
