"""`paramserver checkpoint export DIR [NAME] --since CKPT`: what changed after CKPT, to update a serving copy in place.

A delta export is one safetensors file laid out as a whole export (tools.py), but each table holds
only what changed between the two checkpoints:

- each dense variable whole, under its parameter name (they are small, and every step changes them);
- ``embeddings/<table>/ids`` (int64) and ``embeddings/<table>/weight`` (float32, one row per id):
  the rows of NAME that CKPT did not hold, or held with other values;
- ``embeddings/<table>/deleted`` (int64, sorted): ids that are not rows at NAME and were rows at
  CKPT (evicted since; on a chain it may also name an id created and evicted between the two,
  which removing ignores);
- metadata: ``format`` ("paramserver-export-delta"), ``checkpoint``, ``step``,
  ``checkpoint_sha256`` and ``run_id`` (NAME's), ``since``, ``since_step``, ``since_sha256`` and
  ``since_run_id`` (CKPT's): the exact checkpoint the delta applies to (the SHA-256 of its
  MANIFEST.json names its content) and its run, so that a served copy of another checkpoint of
  the same name (another run's, or one written again) refuses it (serving/loading.py).

`merge_rows` applies it: the deleted ids removed, then the rows written over the stored ones or
added. A whole export of CKPT with the delta applied holds, id by id and bit for bit, the rows of
a whole export of NAME, and its dense values (row order is not part of it: a serving copy looks
rows up by id).

How the changed rows are found. When CKPT is a link of NAME's chain (every shard file's), only the
deltas after it are read: the rows they wrote that are current at NAME, and the ids they deleted
that no later one brought back. Otherwise (CKPT in an older chain, or NAME a base), every row of
NAME is compared with CKPT's, bit for bit, a partition of the ids (by hash) at a time, each small
enough to hold CKPT's rows of it in memory (PARTITION_BYTES; both checkpoints are read once per
partition). Memory stays bounded either way: the rows found are spooled to temporary files beside
the output (their number is known only at the end) and copied after the header.

CKPT must be a complete checkpoint of the same directory, earlier than NAME, with the same table
dims: otherwise a CheckpointError (exit 2) says which.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import IO

import numpy as np

from paramserver.checkpoint import chain
from paramserver.checkpoint.export.export_file import DELTA_FORMAT, EMBEDDINGS, ExportFile, Lineage, check_distinct
from paramserver.checkpoint.files import tensor_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointError, is_checkpoint_name
from paramserver.checkpoint.tools import (
    checkpoint_lineage,
    export_names,
    open_source,
    table_export_names,
    write_export_file,
)

PARTITION_BYTES = 256 << 20  # CKPT's rows held at once when the two checkpoints are compared
MAX_PARTITIONS = 1024  # 256 GB of rows: a larger count read from a file is not believed
_COPY_BYTES = 8 << 20

Emit = Callable[[np.ndarray, np.ndarray], None]


def export_delta(url: str, name: str | None, since: str, out: str | None, note=None) -> str:
    """Write the rows of checkpoint `name` (default: the newest) changed after checkpoint `since`,
    the ids deleted between, and the dense variables (see the module docstring); returns the path."""
    links: dict = {}  # checkpoints opened (and checked) once, whichever of the two chains they are in
    new = open_source(url, name, links)
    old = _since(new, since, url, links)
    values = {var: v.value for info in new.dense_variables().values() for var, v in info["vars"].items()}
    names = export_names(list(values))
    tables = table_export_names(list(new.tables))
    path = out or f"{new.name}.since-{old.name}.safetensors"
    spool = tempfile.mkdtemp(prefix=".delta-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        spooled = {table: os.path.join(spool, str(k)) for k, table in enumerate(new.tables)}
        found = {table: _spool_table(new, old, table, spooled[table]) for table in new.tables}
        shapes: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
            exported: (values[var].dtype, values[var].shape) for var, exported in names.items()
        }
        for table, (rows, deleted) in found.items():
            prefix = f"{EMBEDDINGS}/{tables[table]}"
            shapes[f"{prefix}/ids"] = (np.dtype(np.int64), (rows,))
            shapes[f"{prefix}/weight"] = (np.dtype(np.float32), (rows, new.tables[table]["dim"]))
            shapes[f"{prefix}/deleted"] = (np.dtype(np.int64), deleted.shape)
        metadata = {
            "format": DELTA_FORMAT,
            "step": str(new.step),
            "since_step": str(old.step),
            **checkpoint_lineage(new).metadata(""),
            **checkpoint_lineage(old).metadata("since"),
        }
        layout = tensor_file.plan(shapes, metadata)

        def write_tables(handle) -> None:
            for table, (_, deleted) in found.items():
                prefix = f"{EMBEDDINGS}/{tables[table]}"
                tensor_file.write_rows(handle, layout, f"{prefix}/deleted", 0, deleted)
                for field in ("ids", "weight"):
                    _copy_spooled(f"{spooled[table]}.{field}", handle, layout.offset(f"{prefix}/{field}", 0))

        dense = {exported: values[var] for var, exported in names.items()}
        return write_export_file(path, layout, dense, write_tables, note)
    finally:
        shutil.rmtree(spool, ignore_errors=True)


def run_delta_export(action: str, url: str, name: str | None, out: str | None, since: str) -> int:
    """`paramserver checkpoint export ... --since CKPT`: the path alone on stdout, notes on stderr."""
    if action != "export":
        raise CheckpointError(f"--since is for export (a delta export), not for {action}")
    print(export_delta(url, name, since, out, note=lambda text: print(text, file=sys.stderr)))
    sys.stdout.flush()
    return 0


def _since(new: RestoreSource, since: str, url: str, links: dict) -> RestoreSource:
    """Checkpoint `since`, checked: a complete checkpoint of the same directory, before `new`, of the same tables."""
    if not is_checkpoint_name(since):
        raise CheckpointError(f"--since {str(since)[:80]!r} is not a checkpoint name (ckpt-<9 digits>)")
    if since >= new.name:
        raise CheckpointError(
            f"--since {since} is not earlier than {new.name}: a delta goes forward from an older checkpoint"
        )
    if since not in new.store.complete():
        raise CheckpointError(f"--since {since} is not a complete checkpoint in {url}")
    old = RestoreSource(new.store, since, links=links)
    if old.step > new.step:
        raise CheckpointError(f"--since {since} is at step {old.step}, after {new.name}'s {new.step}: not the same run")
    for table, meta in new.tables.items():
        before = old.tables.get(table)
        if before is not None and before["dim"] != meta["dim"]:
            raise CheckpointError(
                f"--since {since}: table {table!r} has dim {before['dim']} there and {meta['dim']} in {new.name}: "
                f"not the same model"
            )
    return old


def _spool_table(new: RestoreSource, old: RestoreSource, table: str, spool: str) -> tuple[int, np.ndarray]:
    """Write `table`'s changed rows to two spool files (`spool`.ids and .weight); (their number,
    the deleted ids, sorted)."""
    counted = [0]
    with (
        open(f"{spool}.ids", "wb") as ids_file,
        open(f"{spool}.weight", "wb") as weight_file,
    ):

        def emit(ids: np.ndarray, weight: np.ndarray) -> None:
            ids_file.write(np.ascontiguousarray(ids, np.int64).data)
            weight_file.write(np.ascontiguousarray(weight, np.float32).data)
            counted[0] += ids.shape[0]

        linked = all(new.chain_from(index, old.name) is not None for index in new.table_files(table))
        deleted = _from_chain(new, old.name, table, emit) if linked else _compared(new, old, table, emit)
    return counted[0], np.sort(deleted)


def _from_chain(new: RestoreSource, since: str, table: str, emit: Emit) -> np.ndarray:
    """CKPT is a link of every shard file's chain: the rows the later deltas wrote, current at NAME."""
    deleted = [np.zeros(0, np.int64)]
    for index in new.table_files(table):
        links = new.chain_from(index, since) or []
        for ids, arrays in chain.current_slices(links, table, ["values"], first=1):
            emit(ids, arrays["values"])
        deleted.append(chain.deleted_since_first(links, table))
    return np.concatenate(deleted)


def _compared(new: RestoreSource, old: RestoreSource, table: str, emit: Emit) -> np.ndarray:
    """Every row of NAME against CKPT's, bit for bit, a hash partition of the ids at a time."""
    before = old.tables.get(table)
    row_bytes = 8 + 4 * new.tables[table]["dim"]
    parts = min(MAX_PARTITIONS, max(1, math.ceil((before["rows"] if before else 0) * row_bytes / PARTITION_BYTES)))
    deleted = [np.zeros(0, np.int64)]
    for part in range(parts):
        old_ids, old_values = _partition(old, table, part, parts) if before else _empty(new, table)
        seen = np.zeros(old_ids.shape[0], bool)
        for index in new.table_files(table):
            for ids, arrays in new.table_slices(table, index, ["values"], part, parts):
                changed = _changed(old_ids, old_values, seen, ids, arrays["values"])
                if changed.any():
                    emit(ids[changed], arrays["values"][changed])
        deleted.append(old_ids[~seen])
    return np.concatenate(deleted)


def _changed(old_ids, old_values, seen, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Which of `ids` are new or hold other bits than in (sorted) `old_ids`; marks the others `seen`."""
    if not old_ids.shape[0]:
        return np.ones(ids.shape[0], bool)
    at = np.minimum(np.searchsorted(old_ids, ids), old_ids.shape[0] - 1)
    found = old_ids[at] == ids
    seen[at[found]] = True
    same = found.copy()
    same[found] = (old_values[at[found]].view(np.uint32) == values[found].view(np.uint32)).all(axis=1)
    return ~same


def _partition(old: RestoreSource, table: str, part: int, parts: int) -> tuple[np.ndarray, np.ndarray]:
    """CKPT's rows of `table` whose ids hash to `part` of `parts`, sorted by id."""
    ids, values = [np.zeros(0, np.int64)], [np.zeros((0, old.tables[table]["dim"]), np.float32)]
    for index in old.table_files(table):
        for chunk_ids, arrays in old.table_slices(table, index, ["values"], part, parts):
            ids.append(chunk_ids)
            values.append(arrays["values"])
    all_ids = np.concatenate(ids)
    order = np.argsort(all_ids, kind="stable")
    return all_ids[order], np.concatenate(values)[order]


def _empty(new: RestoreSource, table: str) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, np.int64), np.zeros((0, new.tables[table]["dim"]), np.float32)


def _copy_spooled(spooled: str, handle: IO[bytes], offset: int) -> None:
    handle.seek(offset)
    with open(spooled, "rb") as source:
        while data := source.read(_COPY_BYTES):
            handle.write(data)


# ---- reading and applying ---------------------------------------------------------------------
def load_delta(path: str, allow_non_finite: bool = False) -> dict:
    """A delta export as ``{"state_dict": {name: tensor}, "embeddings": {table: {"ids", "weight",
    "deleted"}}, "step", "checkpoint", "sha256", "run_id", "since", "since_step", "since_sha256",
    "since_run_id"}`` (torch tensors; all of it in memory), every part checked as serving checks it
    (export_file.py: dtypes, shapes, one row per id, distinct ids, finite values, the lineage)."""
    import torch  # here: a PS never reads exports

    with ExportFile(path, DELTA_FORMAT, allow_non_finite) as delta:
        state_dict = {name: torch.from_numpy(value) for name, value in delta.dense_values().items()}
        embeddings = {}
        for table in delta.tables:
            ids = delta.ids(table)
            check_distinct(np.sort(ids), f"{path}: table {table!r}")
            weight = np.empty((ids.shape[0], delta.dims()[table]), np.float32)
            for lo, rows in delta.weight_slices(table):
                weight[lo : lo + rows.shape[0]] = rows
            embeddings[table] = {
                "ids": torch.from_numpy(ids),
                "weight": torch.from_numpy(weight),
                "deleted": torch.from_numpy(delta.ids(table, "deleted")),
            }
        new, since, step, since_step = delta.lineage, delta.since, delta.step, delta.since_step
    return {
        "state_dict": state_dict,
        "embeddings": embeddings,
        "step": step,
        "checkpoint": new.checkpoint,
        "sha256": new.sha256,
        "run_id": new.run_id,
        "since": since.checkpoint,
        "since_step": since_step,
        "since_sha256": since.sha256,
        "since_run_id": since.run_id,
    }


def merge_rows(
    ids: np.ndarray, weight: np.ndarray, changed_ids: np.ndarray, changed_weight: np.ndarray, deleted: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rows (`ids`, `weight`) with a delta applied, sorted by id: the `deleted` ids removed, then the
    changed rows written over the stored ones or added."""
    keep = ~(np.isin(ids, deleted) | np.isin(ids, changed_ids))
    merged_ids = np.concatenate([ids[keep], changed_ids])
    merged = np.concatenate([weight[keep], changed_weight.astype(weight.dtype, copy=False)])
    order = np.argsort(merged_ids, kind="stable")
    return merged_ids[order], merged[order]


def apply_to_export(saved: dict, delta: dict) -> dict:
    """`load_export`'s dict of checkpoint CKPT with `load_delta`'s dict (a delta since CKPT) applied:
    the later checkpoint's, in the same shape (each table's rows sorted by id)."""
    import torch  # here: load_export's tensors are torch's

    held = Lineage(saved["checkpoint"], saved.get("sha256", ""), saved.get("run_id", ""))
    since = Lineage(delta["since"], delta["since_sha256"], delta["since_run_id"])
    if held != since:
        raise CheckpointError(f"a delta since {since.describe()} does not apply to {held.describe()}")
    embeddings = {}
    for table, rows in saved["embeddings"].items():
        change = delta["embeddings"].get(table)
        if change is None:
            raise CheckpointError(f"the delta since {delta['since']} has no table {table!r}")
        ids, weight = merge_rows(
            rows["ids"].numpy(),
            rows["weight"].numpy(),
            change["ids"].numpy(),
            change["weight"].numpy(),
            change["deleted"].numpy(),
        )
        embeddings[table] = {"ids": torch.from_numpy(ids), "weight": torch.from_numpy(weight)}
    for table in delta["embeddings"].keys() - saved["embeddings"].keys():  # a table created since
        embeddings[table] = {key: delta["embeddings"][table][key] for key in ("ids", "weight")}
    state_dict = {**saved["state_dict"], **delta["state_dict"]}
    return {
        "state_dict": state_dict,
        "embeddings": embeddings,
        "step": delta["step"],
        "checkpoint": delta["checkpoint"],
        "sha256": delta["sha256"],
        "run_id": delta["run_id"],
    }
