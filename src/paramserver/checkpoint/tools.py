"""`paramserver checkpoint list|inspect|export DIR [NAME]`: look into checkpoints with no cluster.

export writes one safetensors file, a slice of rows at a time (bounded memory whatever the
tables' size): each dense variable under its parameter name, and each table as
``embeddings/<table>/ids`` (int64) and ``embeddings/<table>/weight`` (float32, one row per id),
<table> named as the parameters are: without the optimizer's ``optK.`` prefix, so the module's
path (``user`` for the HashEmbedding whose state_dict key is ``user.placeholder``), or the
module's own ``name=``;
its metadata holds ``format`` ("paramserver-export"), ``step`` and ``checkpoint``, and the
checkpoint's lineage: ``checkpoint_sha256`` (the SHA-256 of its MANIFEST.json) and ``run_id``.
``safetensors.torch.load_file(path)`` reads it, and `load_export(path)` gives ``{"state_dict":
{parameter name: tensor}, "embeddings": {table: {"ids": ..., "weight": ...}}, "step": n,
"checkpoint": name, "sha256": ..., "run_id": ...}``, every part checked (export_file.py).
inspect reads the files' headers only.

Parameter names are the model's when the optimizer was given ``model.named_parameters()``;
``model.load_state_dict({**model.state_dict(), **saved["state_dict"]})`` loads them, failing on
any name or shape the model does not have (embedding placeholders and buffers keep their values).
An optimizer given ``model.parameters()`` saw no names: its variables are ``param0``,
``param1``, ... in the order it got them, and export says so and how to map them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable

import numpy as np

from paramserver.checkpoint.export.export_file import (
    EMBEDDINGS,
    EXPORT_FORMAT,
    ExportFile,
    Lineage,
    is_run_id,
    sorted_rows,
)
from paramserver.checkpoint.files import tensor_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import MANIFEST, CheckpointError, CheckpointStore
from paramserver.checkpoint.verdict import newest_passing_name

_POSITIONAL = re.compile(r"^(?:opt\d+\.)?param\d+$")
_OPTIMIZER_PREFIX = re.compile(r"^opt\d+\.")


def list_checkpoints(url: str) -> list[dict]:
    """One row per complete checkpoint (oldest first), each checked as a resume checks it (every
    file's size and SHA-256, its header and metadata, its values finite): ``"status": "ok"``, or
    ``"damaged: <what is wrong>"`` (a damaged one is never resumed from, nor evaluated).
    A directory that does not exist is a CheckpointError naming it."""
    store = CheckpointStore(url)
    store.require()
    rows = []
    links: dict = {}  # the checkpoints of chains, each opened and checked once
    for name in store.complete():
        row: dict = {"name": name}
        try:
            manifest = store.manifest(name)
            row.update(
                {
                    "step": manifest.get("step"),
                    "shards": manifest.get("num_shards"),
                    "bytes": sum(int(e["bytes"]) for e in manifest["shards"]),
                    "time": manifest.get("time"),
                    "kind": "delta" if store.parent(name) else "base",
                }
            )
        except (CheckpointError, KeyError, TypeError, ValueError):
            pass  # verify() says what is wrong with the manifest
        try:
            source = RestoreSource(store, name, links=links)  # every file of its chain checked, as resume checks it
            row["status"] = "ok"
            if len(source.links) > 1:
                row["chain"] = source.links
        except CheckpointError as exc:
            row["status"] = "damaged: " + str(exc).removeprefix(f"checkpoint {name}: ")
        rows.append(row)
    return rows


def open_source(url: str, name: str | None, links: dict | None = None, allow_non_finite: bool = False) -> RestoreSource:
    """Checkpoint `name` of `url`, every file checked as a resume checks it (`links`: see
    RestoreSource); default: the newest that passes that check, as resume chooses (verdict.py:
    each newer one is logged with what is wrong and skipped)."""
    store = CheckpointStore(url)
    store.require()
    if name is None:
        name = newest_passing_name(store, allow_non_finite)
        if name is None:
            raise CheckpointError(f"no complete checkpoint that passes restore's checks in {url}")
    return RestoreSource(store, name, links=links, allow_non_finite=allow_non_finite)


def checkpoint_lineage(source: RestoreSource) -> Lineage:
    """Which checkpoint `source` is, exactly: its name, the SHA-256 of its MANIFEST.json (the
    manifest names every file's SHA-256, so this hash names the checkpoint's content) and its run."""
    data = source.store.manifest_bytes(source.name)
    try:
        same = json.loads(data) == source.manifest
    except ValueError:
        same = False
    if not same:
        raise CheckpointError(f"checkpoint {source.name}: {MANIFEST} changed while it was read")
    run_id = source.manifest.get("run_id", "")
    if run_id != "" and not is_run_id(run_id):
        raise CheckpointError(f"checkpoint {source.name}: {MANIFEST} has run_id {str(run_id)[:40]!r}, not a run id")
    return Lineage(source.name, hashlib.sha256(data).hexdigest(), run_id)


def inspect(url: str, name: str | None = None) -> dict:
    """Variables (shape, optimizer state, steps) and tables (rows, dim, optimizer) of one checkpoint,
    from the manifest and the files' headers (every file checked against the manifest)."""
    source = open_source(url, name)
    variables = {
        var: {
            "group": group,
            "shape": list(shape),
            "steps": steps,
            "state": states,
            "bytes": source.tensor_bytes(f"dense/{group}/{var}"),
        }
        for var, (group, shape, steps, states) in source.dense_shapes().items()
    }
    tables = {
        table: {
            "rows": int(meta["rows"]),
            "dim": meta["dim"],
            "optimizer": meta["spec"],
            "counters": meta["counters"],
            "encoding": meta.get("encoding", "float32"),  # of this checkpoint's own files' values
            "bytes": source.tensor_bytes(f"table/{table}/"),  # in this checkpoint's own files
        }
        for table, meta in source.tables.items()
    }
    return {
        "name": source.name,
        "step": source.step,
        "shards": source.manifest.get("num_shards"),
        "mode": source.manifest.get("mode"),
        "chain": source.links,  # base first; this checkpoint alone when it is a base
        "variables": variables,
        "tables": tables,
    }


def _natural(name: str) -> list:
    """Sort key that puts param2 before param10 (and opt2 before opt10)."""
    return [int(piece) if piece.isdigit() else piece for piece in re.split(r"(\d+)", name)]


def export_names(variables: list[str]) -> dict[str, str]:
    """Each PS variable's name in the exported state dict, in export order: the parameter's name
    without its optimizer's prefix ("opt0.fc.weight" -> "fc.weight"); an optimizer one of whose
    names another optimizer holds too keeps its prefix on all of them. Sorted naturally:
    positional names in the optimizer's order."""
    split = {var: var.split(".", 1) if "." in var else ["", var] for var in variables}
    taken = Counter(short for _, short in split.values())
    clashing = {prefix for prefix, short in split.values() if taken[short] > 1}
    return {var: var if split[var][0] in clashing else split[var][1] for var in sorted(variables, key=_natural)}


def table_export_names(tables: list[str]) -> dict[str, str]:
    """Each table's name in the exported file, by the dense names' convention: without its
    optimizer's prefix ("opt0.user" -> "user", the module's path); a table given its own name
    keeps it; tables whose names would meet keep their full names."""
    short = {table: _OPTIMIZER_PREFIX.sub("", table, count=1) for table in tables}
    taken = Counter(short.values())
    return {table: name if taken[name] == 1 else table for table, name in short.items()}


def positional_note(names: list[str], path: str) -> str | None:
    """What to tell the user when some exported names are positional (None when there are none)."""
    positional = [name for name in names if _POSITIONAL.match(name)]
    if not positional:
        return None
    shown = ", ".join(positional[:3]) + (f", ... {positional[-1]}" if len(positional) > 3 else "")
    count = f"all {len(names)}" if len(positional) == len(names) else f"{len(positional)} of the {len(names)}"
    lines = [
        f"note: {count} parameter names in {path} are positional ({shown}):",
        "an optimizer was given model.parameters(), which carry no names.",
    ]
    if any("." in name for name in positional):  # two optimizers' names clash: each keeps its prefix
        lines.append(
            "In optK.paramN, optK is the optimizer the script created (K+1)-th and paramN the N-th "
            "parameter it was given."
        )
    else:
        lines += [
            "paramN is the N-th parameter the optimizer was given; to load them into the same model:",
            "    from paramserver import load_export",
            f"    saved = load_export({path!r})",
            "    names = [name for name, _ in model.named_parameters()]",
            "    state = {names[int(key.removeprefix('param'))]: value for key, value in saved['state_dict'].items()}",
            "    model.load_state_dict({**model.state_dict(), **state})",
        ]
    return "\n".join(
        [
            *lines,
            "To keep the model's names in checkpoints, give the optimizer the named parameters:",
            "    ps.optim.Adam(model.named_parameters(), ...)",
        ]
    )


def export(url: str, name: str | None, out: str | None, note=None) -> str:
    """Write the checkpoint's dense values and embedding tables as one safetensors file (see
    `load_export`), streaming the tables a slice at a time; returns its path. `note(text)` is
    told when the parameter names are positional (see `positional_note`)."""
    source = open_source(url, name)
    values = {var: v.value for info in source.dense_variables().values() for var, v in info["vars"].items()}
    names = export_names(list(values))
    shapes: dict[str, tuple[np.dtype, tuple[int, ...]]] = {
        exported: (values[var].dtype, values[var].shape) for var, exported in names.items()
    }
    tables = table_export_names(list(source.tables))
    for table, meta in source.tables.items():
        shapes[f"{EMBEDDINGS}/{tables[table]}/ids"] = (np.dtype(np.int64), (meta["rows"],))
        shapes[f"{EMBEDDINGS}/{tables[table]}/weight"] = (np.dtype(np.float32), (meta["rows"], meta["dim"]))
    metadata = {"format": EXPORT_FORMAT, "step": str(source.step), **checkpoint_lineage(source).metadata("")}
    layout = tensor_file.plan(shapes, metadata)

    def write_tables(handle) -> None:
        for table in source.tables:
            _copy_table(source, table, tables[table], handle, layout)

    path = out or f"{source.name}.safetensors"
    return write_export_file(
        path, layout, {exported: values[var] for var, exported in names.items()}, write_tables, note
    )


def write_export_file(
    path: str, layout: tensor_file.TensorPlan, dense: dict[str, np.ndarray], write_tables: Callable, note=None
) -> str:
    """Write an export (whole or delta) at `path` through a temporary file: `layout`'s header, the
    `dense` values by exported name, then `write_tables(handle)`; a crash leaves no partial file.
    `note(text)` is told when the parameter names are positional (see `positional_note`)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as handle:
            handle.write(layout.header)
            for exported, value in dense.items():
                tensor_file.write_rows(handle, layout, exported, 0, value)
            write_tables(handle)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    text = positional_note(list(dense), path)
    if text is not None and note is not None:
        note(text)
    return path


def _copy_table(source: RestoreSource, table: str, exported: str, handle, layout: tensor_file.TensorPlan) -> None:
    at, rows = 0, layout.tensors[f"{EMBEDDINGS}/{exported}/ids"].shape[0]
    for index in source.table_files(table):
        for ids, arrays in source.table_slices(table, index, ["values"]):
            if at + ids.shape[0] > rows:  # the rows a chain's metadata says, against those it holds
                raise CheckpointError(f"checkpoint {source.name}: table {table!r} holds more than its {rows} rows")
            tensor_file.write_rows(handle, layout, f"{EMBEDDINGS}/{exported}/ids", at, ids)
            tensor_file.write_rows(handle, layout, f"{EMBEDDINGS}/{exported}/weight", at, arrays["values"])
            at += ids.shape[0]
    if at != rows:
        raise CheckpointError(f"checkpoint {source.name}: table {table!r} holds {at} rows, it says {rows}")


def load_export(path: str, allow_non_finite: bool = False) -> dict:
    """An exported file as ``{"state_dict": {name: tensor}, "embeddings": {table: {"ids": int64
    tensor, "weight": float32 tensor}}, "step": n, "checkpoint": name, "sha256": its manifest's
    SHA-256, "run_id": ...}`` (all of it in memory; each table's rows sorted by id), every part
    checked as serving checks it (export_file.py): a CheckpointError names what is wrong."""
    import torch  # here: a PS never reads exports

    with ExportFile(path, EXPORT_FORMAT, allow_non_finite) as saved:
        state_dict = {name: torch.from_numpy(value) for name, value in saved.dense_values().items()}
        embeddings = {}
        for table in sorted(saved.tables, key=_natural):
            ids = saved.ids(table)
            rows = ((ids[lo : lo + len(chunk)], chunk) for lo, chunk in saved.weight_slices(table))
            sorted_ids, weight = sorted_rows(ids, rows, saved.dims()[table], f"{path}: table {table!r}")
            embeddings[table] = {"ids": torch.from_numpy(sorted_ids), "weight": torch.from_numpy(weight)}
        lineage, step = saved.lineage, saved.step
    return {
        "state_dict": {name: state_dict[name] for name in sorted(state_dict, key=_natural)},
        "embeddings": embeddings,
        "step": step,
        "checkpoint": lineage.checkpoint,
        "sha256": lineage.sha256,
        "run_id": lineage.run_id,
    }


def run_tool(action: str, url: str, name: str | None, out: str | None) -> int:
    if action == "list":
        for row in list_checkpoints(url):
            print(json.dumps(row))
    elif action == "inspect":
        print(json.dumps(inspect(url, name), indent=1))
    else:  # the path alone on stdout (for scripts); notes on stderr
        print(export(url, name, out, note=lambda text: print(text, file=sys.stderr)))
    sys.stdout.flush()
    return 0
