"""What was trained, loaded into the model to serve it with no cluster (`paramserver.serving.load`).

Dense values go in by name, strictly (as an evaluator loads them: worker/checkpoint_model.py);
each HashEmbedding (and each table of a HashEmbeddingBagCollection) gets its table's rows as
buffers of its own (worker/served_rows.py) and looks ids up there: no `paramserver.init()`, no
PS, and a model that `torch.export` captures whole. An id the table does not hold gets a zero row.
"""

from __future__ import annotations

import os

import torch

from ..base.errors import InvalidArgumentError
from ..checkpoint.delta_export import load_delta
from ..checkpoint.store import CheckpointError
from ..checkpoint.tools import load_export, open_source
from .checkpoint_model import dense_state, match_tables, named_state
from .served_rows import ServedRows


def load(model: torch.nn.Module, path: str, checkpoint: str | None = None) -> dict:
    """Load `path` into `model` for serving, and return ``{"step": n, "checkpoint": name, "tables":
    {module path: table}}``.

    `path`: a file written by ``paramserver checkpoint export``, or a checkpoint directory (a
    local path or URL; its newest complete checkpoint, or the one named `checkpoint`). Every name
    and shape is checked before the model changes (a CheckpointError names what does not fit: a
    parameter or table the model lacks, a table of another dim, a HashEmbedding with no table).
    """
    if os.path.isfile(path):
        if checkpoint is not None:
            raise InvalidArgumentError(f"{path} is an exported file, which holds one checkpoint: name none")
        saved = load_export(path)
        where, step, name = path, saved["step"], saved["checkpoint"]
        state = named_state(model, saved["state_dict"], path)
        tables = {table: (got["ids"], got["weight"]) for table, got in saved["embeddings"].items()}
    else:
        source = open_source(path, checkpoint)
        where, step, name = f"checkpoint {source.name}", source.step, source.name
        state = dense_state(model, source)
        tables = {}
        for table in source.tables:
            rows = source.saved_table(table)
            tables[table] = (torch.from_numpy(rows.ids), torch.from_numpy(rows.arrays["values"]))
    matched = match_tables(model, {table: int(weight.shape[1]) for table, (_, weight) in tables.items()}, where)
    model.load_state_dict({**model.state_dict(), **state})
    paths = {id(module): path for path, module in model.named_modules()}
    for module, table in matched:
        module.served = ServedRows(*tables[table], module.dtype, checkpoint=name)
    return {"step": step, "checkpoint": name, "tables": {paths[id(module)]: table for module, table in matched}}


def apply_delta(model: torch.nn.Module, path: str) -> dict:
    """Update a model `load` served checkpoint CKPT with `path`, a file written by ``paramserver
    checkpoint export --since CKPT``: its rows replace or join each table's, its deleted ids are
    removed, its dense values are loaded; the model then serves the delta's checkpoint, exactly as
    `load` of that checkpoint's whole export would (id by id, bit for bit). Returns ``{"step",
    "checkpoint", "since", "tables": {module path: {"rows", "deleted"}}}``.

    Everything is checked before the model changes: each served table must be CKPT's (a
    CheckpointError names the one that is not), and names and shapes as `load` checks them."""
    delta = load_delta(path)
    state = named_state(model, delta["state_dict"], path)
    dims = {table: int(got["weight"].shape[1]) for table, got in delta["embeddings"].items()}
    matched = match_tables(model, dims, path)
    paths = {id(module): name for name, module in model.named_modules()}
    targets = [
        (_served_since(module, delta["since"], paths[id(module)], path), table, module) for module, table in matched
    ]
    model.load_state_dict({**model.state_dict(), **state})
    applied = {}
    for served, table, module in targets:
        got = delta["embeddings"][table]
        served.update_rows(got["ids"], got["weight"], got["deleted"], delta["checkpoint"])
        applied[paths[id(module)]] = {"rows": int(got["ids"].shape[0]), "deleted": int(got["deleted"].shape[0])}
    return {"step": delta["step"], "checkpoint": delta["checkpoint"], "since": delta["since"], "tables": applied}


def _served_since(module: torch.nn.Module, since: str, where: str, path: str) -> ServedRows:
    """The rows `module` serves, which must be checkpoint `since`'s."""
    served = getattr(module, "served", None)
    if not isinstance(served, ServedRows) or served.checkpoint != since:
        held = served.checkpoint if isinstance(served, ServedRows) else ""
        raise CheckpointError(f"{path} is a delta since {since}; {where} serves {held or 'no checkpoint'}'s rows")
    return served
