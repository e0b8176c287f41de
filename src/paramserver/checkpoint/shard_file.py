"""A shard's state as one safetensors file, written a slice at a time.

Tensor names: ``dense/<group>/<part>`` (values, shaped like the part), ``dense/<group>/<part>/<state>``
(each optimizer state), ``table/<table>/ids|values|<state>|row_step|last_seen|seen`` (one row per
stored id, in row order). The file's metadata key ``paramserver`` holds JSON: the shard index,
its version and sync step, each group's optimizer spec and per-part step counts, and each
table's dim, optimizer, initializer, row policy, counters, update count and rows, and the
encoding of its values when they are quantized (quantize.py: ``values`` in bfloat16, or int8 with
``values.scale``; optimizer state stays float32).

A delta (incremental checkpoint, docs/checkpoints.md) has the same tensors, but a table's holds
only the rows changed since the snapshot of checkpoint ``parent`` (named in the metadata), plus
``table/<table>/deleted``: the ids evicted since (int64). Dense variables, counters and positions
are always whole.

Consistency without a copy of the tables: the dense variables are copied (they are small) and
every table's snapshot begins while no push can change them, at one step; the table rows are
then written a slice at a time while training goes on (server/row_snapshot.py). Memory: the
dense copy, one slice, and the rows changed during the write (bounded; see TableStore).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import IO, Any

import numpy as np

from ..server.dense import DenseGroup
from ..server.shard import Shard
from ..server.table_store import TableStore
from . import quantize, tensor_file
from .store import CheckpointStore, ShardFile

log = logging.getLogger(__name__)
META_KEY = "paramserver"
_ONE_AT_A_TIME = threading.Lock()  # a process writes one checkpoint file at a time


def write(
    store: CheckpointStore,
    name: str,
    shard: Shard,
    tables: TableStore,
    parent: tuple[str, int] | None = None,
    forget: int | None = None,
    encoding: str = quantize.NONE,
) -> ShardFile:
    """Write `shard`'s file of checkpoint `name`: its state at one step, streamed. `parent`: (name,
    snapshot epoch) of an earlier checkpoint of this shard to write a delta on (whole when the
    tables cannot: tiered ones). `forget`: see TableStore.begin_snapshot. Returns the manifest
    entry; its `parent` names the checkpoint the file is a delta on ("": whole)."""
    started = time.monotonic()
    with _ONE_AT_A_TIME:
        dense, meta, snapshots = shard.snapshot(
            lambda groups, version, sync_step: _begin(shard, tables, groups, version, sync_step, parent, forget)
        )
        if encoding != quantize.NONE:
            for table_meta in meta["tables"].values():
                table_meta["encoding"] = encoding
        try:
            entry = store.write_shard_with(
                name, shard.index, lambda handle: _fill(handle, dense, meta, snapshots, tables, encoding)
            )
        finally:
            kept = tables.end_snapshot()
    log.info(
        "checkpoint %s: shard %d wrote %d bytes in %.2fs (%s; rows kept aside for it: %d bytes at most)",
        name,
        shard.index,
        entry.bytes,
        time.monotonic() - started,
        f"a delta on {meta['parent']}" if meta.get("parent") else "whole",
        max(kept.values(), default=0),
    )
    return dataclasses.replace(entry, parent=meta.get("parent", ""))


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
    if parent is not None and all(snapshot.since is not None for _, snapshot in snapshots.values()):
        meta["parent"] = parent[0]
    return dense, meta, snapshots


def _fill(
    handle: IO[bytes], dense: dict[str, np.ndarray], meta: dict, snapshots: dict, tables: TableStore, encoding: str
) -> None:
    """Write the file: header and dense tensors, then each table's slices at their places (values
    in `encoding`)."""
    shapes: dict[str, tuple[np.dtype, tuple[int, ...]]] = {key: (a.dtype, a.shape) for key, a in dense.items()}
    for table_name, (_, snapshot) in snapshots.items():
        for key, (dtype, row_shape) in snapshot.layout.items():
            stored = quantize.layout(encoding, row_shape) if key == "values" else {key: (dtype, row_shape)}
            for stored_key, (stored_dtype, stored_shape) in stored.items():
                shapes[f"table/{table_name}/{stored_key}"] = (stored_dtype, (snapshot.rows, *stored_shape))
        if meta.get("parent"):
            shapes[f"table/{table_name}/deleted"] = (np.dtype(np.int64), snapshot.deleted.shape)
            dense[f"table/{table_name}/deleted"] = snapshot.deleted
    layout = tensor_file.plan(shapes, {META_KEY: json.dumps(meta)})
    handle.write(layout.header)
    for key, array in dense.items():
        tensor_file.write_rows(handle, layout, key, 0, array)
    for table_name in snapshots:
        while (taken := tables.next_slice(table_name)) is not None:
            lo, arrays = taken
            if encoding != quantize.NONE:
                arrays = {**arrays, **quantize.encode(arrays["values"], encoding)}
            for key, array in arrays.items():
                tensor_file.write_rows(handle, layout, f"table/{table_name}/{key}", lo, array)
