"""A shard's state as one safetensors file, written a slice at a time.

Tensor names: ``dense/<group>/<part>`` (values, shaped like the part), ``dense/<group>/<part>/<state>``
(each optimizer state), ``table/<table>/ids|values|<state>|row_step|last_seen|seen`` (one row per
stored id, in row order). The file's metadata key ``paramserver`` holds JSON: the shard index,
its version and sync step, each group's optimizer spec and per-part step counts, and each
table's dim, optimizer, initializer, row policy, counters, update count and rows, the shard
count its ids are routed over (``shards``), and the encoding of its values when they are
quantized (quantize.py: ``values`` in bfloat16, or int8 with ``values.scale``; optimizer state
stays float32).

A delta (incremental checkpoint, docs/checkpoints.md) has the same tensors, but a table's holds
only the rows changed since the snapshot of checkpoint ``parent`` (named in the metadata), plus
``table/<table>/deleted``: the ids evicted since (int64). Dense variables, counters and positions
are always whole.

Checked as written, with the checks restore applies (docs/checkpoints.md, "Checked as written"):
the metadata is validated with restore's schema against the planned tensors before a byte is
written (shard_meta.py); each slice is checked as it is written, from the arrays in memory
(values.py: finite unless allowed, int8 scales in range; quantized rows before they are encoded;
the slices in order, as many rows as planned; every id this shard's over the table's registered
shard count, which the metadata records as ``shards``); the written file's size, header and
metadata are read back and parsed as restore parses them before it takes its name. Ids are not
checked distinct here: a table's come from its hash index, which holds each once, and a snapshot
is rows 0..n-1 with eviction held until it ends. A problem is a CheckpointError naming the file
and the tensor, and leaves no file.

Consistency without a copy of the tables: the dense variables are copied (they are small) and
every table's snapshot begins while no push can change them, at one step; the table rows are
then written a slice at a time while training goes on (tables/row_snapshot.py). Memory: the
dense copy, one slice, and the rows changed during the write (bounded; see TableStore).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import IO, Any, cast

import numpy as np

from paramserver.base.hashing import mix64
from paramserver.checkpoint.files import chunks, quantize, shard_meta, tensor_file, values
from paramserver.checkpoint.files.tensor_file import TensorReader
from paramserver.checkpoint.store import CheckpointError, CheckpointStore, ShardFile, shard_file_name
from paramserver.server.dense import DenseGroup
from paramserver.server.shard import Shard
from paramserver.tables.table_store import TableStore

log = logging.getLogger(__name__)
META_KEY = "paramserver"
_ONE_AT_A_TIME = threading.Lock()  # a process writes one checkpoint file at a time
_ROUTE_BLOCK = 1 << 14  # ids hashed at a time to check their shard: its temporaries stay in the CPU's cache


def write(
    store: CheckpointStore,
    name: str,
    shard: Shard,
    tables: TableStore,
    parent: tuple[str, int] | None = None,
    forget: int | None = None,
    encoding: str = quantize.NONE,
    allow_non_finite: bool = False,
) -> ShardFile:
    """Write `shard`'s file of checkpoint `name`: its state at one step, streamed, and checked as
    it is written (see "Checked as written" in the module docstring; `allow_non_finite`: NaN and infinite values
    pass, as restore_non_finite lets restore take them). `parent`: (name, snapshot epoch) of an
    earlier checkpoint of this shard to write a delta on (whole when the tables cannot: tiered
    ones). `forget`: see TableStore.begin_snapshot. Returns the manifest entry; its `parent` names
    the checkpoint the file is a delta on ("": whole). A CheckpointError naming the problem leaves
    no file. `begin` then `PendingFile.finish`, in one call."""
    return begin(store, name, shard, tables, parent, forget, encoding, allow_non_finite).finish()


def begin(
    store: CheckpointStore,
    name: str,
    shard: Shard,
    tables: TableStore,
    parent: tuple[str, int] | None = None,
    forget: int | None = None,
    encoding: str = quantize.NONE,
    allow_non_finite: bool = False,
) -> PendingFile:
    """Take the cut of `shard`'s file of checkpoint `name` (arguments as `write`'s): under the shard's
    lock, the dense variables are copied and every table's snapshot begins; returns at once. Training
    may go on; the file is written by `finish` (on any thread), which must follow: until it ends, the
    tables keep the rows changed since aside for it. A problem found before a byte is written is a
    CheckpointError, and the snapshot is ended."""
    dense, meta, snapshots = shard.snapshot(
        lambda groups, version, sync_step: _begin(shard, tables, groups, version, sync_step, parent, forget)
    )
    try:
        if encoding != quantize.NONE:
            for table_meta in meta["tables"].values():
                table_meta["encoding"] = encoding
        where = f"checkpoint {name}: {shard_file_name(shard.index)}"
        writer = _Writer(where, dense, meta, snapshots, tables, allow_non_finite)
    except BaseException:
        tables.end_snapshot()
        raise
    return PendingFile(store, name, shard.index, tables, writer, meta.get("parent", ""))


class PendingFile:
    """A shard file whose cut is taken (`begin`) and whose rows are still to be written (`finish`)."""

    def __init__(
        self, store: CheckpointStore, name: str, index: int, tables: TableStore, writer: _Writer, parent: str
    ) -> None:
        self.store, self.name, self.index, self.tables = store, name, index, tables
        self.writer, self.parent = writer, parent
        self.begun = time.monotonic()
        # a table that cannot keep changed rows aside (tiered) takes no change until the file is written
        self.holds_changes = any(snapshot.holds_changes for _, snapshot in writer.snapshots.values())
        self.written = 0  # bytes written so far (read by other threads: the write's progress)

    def finish(self) -> ShardFile:
        """Stream the file, a slice at a time, checked as written (one file at a time per process: the
        disk's rate is shared, not split), then end the tables' snapshot, also on failure. Returns the
        manifest entry."""
        try:
            with _ONE_AT_A_TIME:
                entry = self.store.write_shard_with(self.name, self.index, self._fill, self.writer.check_written)
        finally:
            kept = self.tables.end_snapshot()
        log.info(
            "checkpoint %s: shard %d wrote %d bytes in %.2fs (%s; rows kept aside for it: %d bytes at most)",
            self.name,
            self.index,
            entry.bytes,
            time.monotonic() - self.begun,
            f"a delta on {self.parent}" if self.parent else "whole",
            max(kept.values(), default=0),
        )
        return dataclasses.replace(entry, parent=self.parent)

    def _fill(self, handle: IO[bytes]) -> None:
        self.writer.fill(cast(IO[bytes], _Counted(handle, self)))


class _Counted:
    """A file handle that adds what is written through it to its PendingFile's `written`."""

    def __init__(self, handle: IO[bytes], pending: PendingFile) -> None:
        self._handle, self._pending = handle, pending

    def write(self, data: Any) -> int:
        count = self._handle.write(data)
        self._pending.written += memoryview(data).nbytes
        return count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _begin(
    shard: Shard,
    tables: TableStore,
    groups: dict[str, DenseGroup],
    version: int,
    sync_step: int,
    parent: tuple[str, int] | None,
    forget: int | None,
):
    """Under the shard's lock: copy the dense variables and begin the tables' snapshots."""
    dense: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {
        "shard": shard.index,
        "version": version,
        "sync_step": sync_step,
        "groups": {},
        "tables": {},
        "positions": {str(w): p for w, p in shard.positions().items()},
    }
    for group_name, group in groups.items():
        meta["groups"][group_name] = {"spec": group.spec, "steps": dict(group.steps)}
        for part, slot in group.slots.items():
            dense[f"dense/{group_name}/{part}"] = group.view(part).copy()
            for key, array in group.state.items():
                dense[f"dense/{group_name}/{part}/{key}"] = array[slot.start : slot.stop].reshape(slot.shape).copy()
    snapshots = tables.begin_snapshot(since=parent[1] if parent else None, forget=forget)
    for table_name, (table_meta, _) in snapshots.items():
        meta["tables"][table_name] = table_meta
        if table_name in tables.shard_counts:  # what its ids are checked against as they are written
            table_meta["shards"] = tables.shard_counts[table_name]
    if parent is not None and all(snapshot.since is not None for _, snapshot in snapshots.values()):
        meta["parent"] = parent[0]
    return dense, meta, snapshots


class _Writer:
    """One shard file: planned and its metadata checked before a byte is written (`__init__`),
    written and its slices checked (`fill`), its header read back (`check_written`). Each tensor's
    chunk hashes (chunks.py) are taken as its rows go by, in order, and written into the header,
    planned with a placeholder of their length, once the data is written."""

    def __init__(
        self,
        where: str,
        dense: dict[str, np.ndarray],
        meta: dict,
        snapshots: dict,
        tables: TableStore,
        allow_non_finite: bool,
    ) -> None:
        self.where, self.dense, self.snapshots, self.tables = where, dense, snapshots, tables
        self.allow_non_finite = allow_non_finite
        self.meta, self.shapes = meta, {key: (a.dtype, a.shape) for key, a in dense.items()}
        self.rows: dict[str, int] = {}  # table -> rows its file holds
        for table_name, (_, snapshot) in snapshots.items():
            self.rows[table_name] = snapshot.rows
            for key, (dtype, row_shape) in snapshot.layout.items():
                stored = quantize.layout(_encoding(meta, table_name), row_shape) if key == "values" else None
                for stored_key, (stored_dtype, stored_shape) in (stored or {key: (dtype, row_shape)}).items():
                    self.shapes[f"table/{table_name}/{stored_key}"] = (stored_dtype, (snapshot.rows, *stored_shape))
            if meta.get("parent"):
                self.shapes[f"table/{table_name}/deleted"] = (np.dtype(np.int64), snapshot.deleted.shape)
                dense[f"table/{table_name}/deleted"] = snapshot.deleted
        self.text = json.dumps(meta)
        sizes = {key: np.dtype(dtype).itemsize * int(np.prod(shape)) for key, (dtype, shape) in self.shapes.items()}
        self.hashes = chunks.Hasher(sizes)  # each tensor's chunk hashes, taken as its rows are written
        self.layout = tensor_file.plan(self.shapes, {META_KEY: self.text, chunks.KEY: self.hashes.placeholder()})
        # restore's own schema and layout checks, on the plan: bad metadata is never written
        shard_meta.parse(self.text, self.layout.tensors, where)

    def fill(self, handle: IO[bytes]) -> None:
        """Write the file: header and dense tensors, then each table's slices at their places
        (values in their encoding), each checked before it is written."""
        handle.write(self.layout.header)
        for key, array in self.dense.items():
            self._write(handle, key, 0, array)
        for table_name in self.snapshots:
            self._write_table(handle, table_name)
        self._write_hashes(handle)

    def _write_hashes(self, handle: IO[bytes]) -> None:
        """The header again, the chunk hashes in place of its placeholder (the same length)."""
        missing = self.hashes.missing()
        if missing is not None:
            raise CheckpointError(f"{self.where}: tensor {missing!r} was not written whole")
        record = self.hashes.text(chunks.header_digest(self.text, self.layout.tensors))
        final = tensor_file.plan(self.shapes, {META_KEY: self.text, chunks.KEY: record})
        if len(final.header) != len(self.layout.header) or final.tensors != self.layout.tensors:
            raise CheckpointError(f"{self.where}: its chunk hashes do not fit the header planned for them")
        self.layout = final
        handle.seek(0)
        handle.write(final.header)

    def _write_table(self, handle: IO[bytes], table: str) -> None:
        encoding, at = _encoding(self.meta, table), 0
        while (taken := self.tables.next_slice(table)) is not None:
            lo, arrays = taken
            counts = {array.shape[0] for array in arrays.values()}
            if lo != at or len(counts) != 1:
                raise CheckpointError(
                    f"{self.where}: table {table!r} gave rows {lo}.. after {at} rows ({sorted(counts)} per tensor)"
                )
            if encoding != quantize.NONE:  # checked before encoding: int8 would turn an infinity into a finite code
                self._check(f"table/{table}/values", arrays["values"])
                arrays = {**arrays, **quantize.encode(arrays["values"], encoding)}
            self._check_route(table, arrays["ids"])
            for key, array in arrays.items():
                self._write(handle, f"table/{table}/{key}", lo, array)
            at += counts.pop()
        if at != self.rows[table]:
            raise CheckpointError(f"{self.where}: table {table!r} wrote {at} rows of the {self.rows[table]} it holds")
        if f"table/{table}/deleted" in self.dense:
            self._check_route(table, self.dense[f"table/{table}/deleted"])

    def _check_route(self, table: str, ids: np.ndarray) -> None:
        """Every id is this shard's (`shard_of` over the shards the table was registered with): a
        restore onto as many shards reads each shard's own file and refuses another's id."""
        shards, index = self.meta["tables"][table].get("shards") or 1, self.meta["shard"]
        if shards == 1 and index == 0:
            return
        for lo in range(0, ids.shape[0], _ROUTE_BLOCK):
            hashed = mix64(ids[lo : lo + _ROUTE_BLOCK])
            # shard_of's rule; a mask where the count is a power of two (a division per id costs 3x more)
            owner = hashed & np.uint64(shards - 1) if shards & (shards - 1) == 0 else hashed % np.uint64(shards)
            other = np.flatnonzero(owner != np.uint64(index))
            if other.shape[0]:
                raise CheckpointError(
                    f"{self.where}: table {table!r} holds id {int(ids[lo + other[0]])}, which belongs to shard "
                    f"{int(owner[other[0]])} of {shards}; not written"
                )

    def _write(self, handle: IO[bytes], key: str, row: int, array: np.ndarray) -> None:
        if key not in self.layout.tensors:
            raise CheckpointError(f"{self.where}: tensor {key!r} is not in the file's plan")
        self._check(key, array)
        tensor_file.write_rows(handle, self.layout, key, row, array)
        spec = self.layout.tensors[key]
        self.hashes.add(key, row * spec.row_bytes, np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)

    def _check(self, key: str, array: np.ndarray) -> None:
        problem = values.problem(key, array, self.allow_non_finite)
        if problem is not None:
            raise CheckpointError(f"{self.where}: {problem}; not written")

    def check_written(self, handle: IO[bytes], size: int) -> None:
        """The written file, read back where it is not the values: its size, and its header and
        metadata parsed as restore parses them (tensor_file.py, shard_meta.py), the same as planned."""
        if size != self.layout.size:
            raise CheckpointError(f"{self.where}: {size} bytes written, {self.layout.size} planned")
        reader = TensorReader(handle, size, self.where)
        shard_meta.parse(reader.metadata.get(META_KEY), reader.tensors, self.where)
        chunks.parse(reader.metadata.get(chunks.KEY), reader.metadata.get(META_KEY), reader.tensors, self.where)
        written = {META_KEY: self.text, chunks.KEY: self.hashes.text(chunks.header_digest(self.text, reader.tensors))}
        if reader.tensors != self.layout.tensors or reader.metadata != written:
            raise CheckpointError(f"{self.where}: its header reads back other than it was written")


def _encoding(meta: dict, table: str) -> str:
    """How table `table`'s values are stored (quantize.py; write() names it in the metadata)."""
    return str(meta["tables"][table].get("encoding", quantize.NONE))
