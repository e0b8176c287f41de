"""What was trained, loaded into the model to serve it with no cluster (`paramserver.serving.load`).

Dense values go in by name (as an evaluator loads them: serving/checkpoint_model.py); each
HashEmbedding (and each table of a HashEmbeddingBagCollection) gets its table's rows as buffers
of its own (nn/served_rows.py) and looks ids up there: no `paramserver.init()`, no PS, and a
model that `torch.export` captures whole. An id the table does not hold gets a zero row.

A file handed in is checked as restore checks a checkpoint (checkpoint/export/export_file.py), and a
checkpoint directory is read through RestoreSource, which applies restore's own checks; all of
it before the model changes. The model remembers the exact checkpoint it serves (`served`: name,
manifest SHA-256, run id), and `apply_delta` takes only a delta since exactly that one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from paramserver.base.errors import InvalidArgumentError
from paramserver.checkpoint.export.export_file import DELTA_FORMAT, EXPORT_FORMAT, ExportFile, Lineage, sorted_rows
from paramserver.checkpoint.store import CheckpointError
from paramserver.checkpoint.tools import checkpoint_lineage, open_source
from paramserver.nn.hash_embedding import HashEmbedding
from paramserver.nn.served_rows import ServedRows
from paramserver.serving.checkpoint_model import (
    dense_values,
    find_tables,
    missing_message,
    named_state,
    table_rows,
    unknown_message,
)

_LINEAGE = "_paramserver_served"  # the model's attribute naming what it serves


@dataclass
class _Read:
    """What `load` read and checked, before the model changes."""

    lineage: Lineage
    step: int
    state: dict[str, torch.Tensor]  # dense values by the model's names
    matched: list[tuple[HashEmbedding, str]]  # (module, its table)
    tables: dict[str, tuple[np.ndarray, np.ndarray]]  # table -> (sorted ids, rows and the zero row)
    lacking: list[tuple[str, HashEmbedding]]  # (path, module) of HashEmbeddings with no table (strict=False)
    missing: list[str]  # what the file lacks (strict=False)
    unexpected: list[str]  # what the model lacks (strict=False)


def load(
    model: torch.nn.Module,
    path: str,
    checkpoint: str | None = None,
    *,
    strict: bool = True,
    allow_non_finite: bool = False,
) -> dict:
    """Load `path` into `model` for serving, and return ``{"step", "checkpoint", "sha256", "run_id",
    "tables": {module path: table}, "missing": [...], "unexpected": [...]}``.

    `path`: a file written by ``paramserver checkpoint export``, or a checkpoint directory (a local
    path or URL; the one named `checkpoint`, or else the newest that passes restore's checks, as
    resume chooses). Everything is checked before the model changes (a CheckpointError names what
    is wrong): the file as restore checks a checkpoint (float32 values, finite unless
    `allow_non_finite`; int64 ids, distinct, one row each; every count against the file's size),
    names and shapes (a table of another dim). `strict` (the default): a parameter or
    HashEmbedding of the model that the file lacks, or one the file holds and the model lacks, is
    an error naming it; with ``strict=False`` they are listed in "missing" and "unexpected", a
    parameter keeps its value and a HashEmbedding with no table serves zero rows.
    """
    if os.path.isfile(path):
        if checkpoint is not None:
            raise InvalidArgumentError(f"{path} is an exported file, which holds one checkpoint: name none")
        read = _from_export(model, str(path), strict, allow_non_finite)
    else:
        read = _from_checkpoint(model, path, checkpoint, strict, allow_non_finite)
    model.load_state_dict({**model.state_dict(), **read.state})
    paths = {id(module): name for name, module in model.named_modules()}
    for module, table in read.matched:
        module.served = ServedRows(*read.tables[table], module.dtype, read.lineage)
    for _, module in read.lacking:
        module.served = ServedRows.empty(module.dim, module.dtype, read.lineage)
    setattr(model, _LINEAGE, read.lineage)
    return {
        "step": read.step,
        "checkpoint": read.lineage.checkpoint,
        "sha256": read.lineage.sha256,
        "run_id": read.lineage.run_id,
        "tables": {paths[id(module)]: table for module, table in read.matched},
        "missing": read.missing,
        "unexpected": read.unexpected,
    }


def _from_export(model: torch.nn.Module, path: str, strict: bool, allow_non_finite: bool) -> _Read:
    """`load`'s reading of an export file, everything checked; the model unchanged."""
    with ExportFile(path, EXPORT_FORMAT, allow_non_finite) as saved:
        matched, lacking, unused = find_tables(model, saved.dims(), path)
        state, missing, unknown = named_state(model, _tensors(saved.dense_values()), path)
        _check_strict(strict, path, missing, unknown, lacking, unused)
        tables = {
            table: sorted_rows(saved.ids(table), saved.rows_slices(table), dim, f"{path}: table {table!r}", True)
            for table, dim in saved.dims().items()
            if table not in unused
        }
        missing += [where for where, _ in lacking]
        return _Read(saved.lineage, saved.step, state, matched, tables, lacking, missing, unknown + unused)


def _from_checkpoint(model: torch.nn.Module, url: str, name: str | None, strict: bool, allow_non_finite: bool) -> _Read:
    """`load`'s reading of a checkpoint through restore's checks (its verdict); the model unchanged."""
    source = open_source(url, name, allow_non_finite=allow_non_finite)
    where = f"checkpoint {source.name}"
    dims = {table: meta["dim"] for table, meta in source.tables.items()}
    matched, lacking, unused = find_tables(model, dims, where)
    state, missing, unknown = named_state(model, dense_values(source), where)
    _check_strict(strict, where, missing, unknown, lacking, unused)
    tables = {}
    for table in dims.keys() - set(unused):
        ids, rows = table_rows(source, table)
        tables[table] = sorted_rows(ids, rows, dims[table], f"{where}: table {table!r}", True)
    missing += [path for path, _ in lacking]
    lineage = checkpoint_lineage(source)
    return _Read(lineage, source.step, state, matched, tables, lacking, missing, unknown + unused)


def apply_delta(model: torch.nn.Module, path: str, *, strict: bool = True, allow_non_finite: bool = False) -> dict:
    """Update a model `load` served checkpoint CKPT with `path`, a file written by ``paramserver
    checkpoint export --since CKPT``: its rows replace or join each table's, its deleted ids are
    removed, its dense values are loaded; the model then serves the delta's checkpoint, exactly as
    `load` of that checkpoint's whole export would (id by id, bit for bit). Returns ``{"step",
    "checkpoint", "since", "tables": {module path: {"rows", "deleted"}}}``.

    Everything is checked before the model changes: the delta must be since exactly the checkpoint
    the model serves (name, manifest SHA-256 and run id: a CheckpointError names both otherwise),
    the file as `load` checks one, names and shapes (`strict` as for `load`). Memory: each table's
    new buffers beside the old ones and the delta's ids; its rows are read a slice at a time."""
    held = served(model)
    with ExportFile(path, DELTA_FORMAT, allow_non_finite) as delta:
        if held is None or held != delta.since:
            serving = held.describe() if held is not None else "no checkpoint (serving.load one first)"
            raise CheckpointError(f"{path} is a delta since {delta.since.describe()}; the model serves {serving}")
        where = str(path)
        matched, lacking, unused = find_tables(model, delta.dims(), where)
        state, missing, unknown = named_state(model, _tensors(delta.dense_values()), where)
        _check_strict(strict, where, missing, unknown, lacking, unused)
        paths = {id(module): name for name, module in model.named_modules()}
        targets = [(_served_rows(module, held, paths[id(module)], where), table, module) for module, table in matched]
        staged = []
        for rows, table, module in targets:
            buffers = rows.merged(
                delta.ids(table),
                delta.rows_slices(table),
                delta.id_slices(table, "deleted"),
                f"{where}: table {table!r}",
            )
            counts = {"rows": delta.rows(table), "deleted": delta.tables[table]["deleted"].shape[0]}
            staged.append((rows, buffers, counts, module))
        new, step = delta.lineage, delta.step
    model.load_state_dict({**model.state_dict(), **state})
    for rows, (ids, weight), _, _ in staged:
        rows.install(ids, weight, new)
    setattr(model, _LINEAGE, new)
    return {
        "step": step,
        "checkpoint": new.checkpoint,
        "since": held.checkpoint,
        "tables": {paths[id(module)]: counts for _, _, counts, module in staged},
    }


def served(model: torch.nn.Module) -> Lineage | None:
    """The checkpoint `model` serves (`load` or `apply_delta` put it there), or None."""
    lineage = getattr(model, _LINEAGE, None)
    return lineage if isinstance(lineage, Lineage) else None


def _served_rows(module: HashEmbedding, held: Lineage, where: str, path: str) -> ServedRows:
    """The rows `module` serves, which must be the model's checkpoint's (a module given other rows
    since is refused)."""
    rows = module.served
    if not isinstance(rows, ServedRows) or rows.lineage != held:
        serving = rows.lineage.describe() if isinstance(rows, ServedRows) else "no checkpoint"
        raise CheckpointError(f"{path} is a delta since {held.describe()}; {where} serves {serving}'s rows")
    return rows


def _check_strict(strict: bool, where: str, missing: list, unknown: list, lacking: list, unused: list) -> None:
    if not strict:
        return
    if unknown:
        raise CheckpointError(unknown_message(where, unknown))
    if unused:
        raise CheckpointError(f"{where}: table(s) {unused} match no HashEmbedding of the model")
    if lacking:
        path = lacking[0][0]
        raise CheckpointError(
            f"{where} has no table for the model's HashEmbedding {path!r} (strict=False serves it zero rows)"
        )
    if missing:
        raise CheckpointError(missing_message(where, missing))


def _tensors(values: dict) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(value) for name, value in values.items()}
