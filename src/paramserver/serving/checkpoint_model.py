"""A checkpoint loaded into the user's torch model, with no PS: what an evaluator evaluates.

Dense variables go in by the names `paramserver checkpoint export` gives them (the model's own
names, the optimizer's `optK.` prefix dropped; positional `paramN` as the N-th parameter of
`model.parameters()`), strictly: a variable the model lacks, or of another shape, is an error, and
what the checkpoint does not hold (buffers, embedding placeholders) keeps its value. Each
HashEmbedding is attached to its table's saved rows and looks them up locally, as a PS reading that
checkpoint would answer: a saved row's values, an id never stored its table's initial values.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from paramserver.checkpoint.restore import RestoreSource, SavedTable
from paramserver.checkpoint.store import CheckpointError
from paramserver.checkpoint.tools import export_names
from paramserver.nn.hash_embedding import HashEmbedding
from paramserver.tables.embedding_table import initial_rows

_POSITIONAL = re.compile(r"^param(\d+)$")
_OPTIMIZER_PREFIX = re.compile(r"^opt\d+\.")


class SavedRows:
    """The saved rows of a checkpoint's tables, answering `lookup` as a PS would (a HashEmbedding's
    `_tables`). Read-only, so thread-safe."""

    def __init__(self, tables: dict[str, SavedTable]) -> None:
        self._tables = {name: _sorted(saved) for name, saved in tables.items()}

    def lookup(self, table: str, ids: np.ndarray) -> np.ndarray:
        """Rows of the distinct `ids` (len(ids) x dim, float32)."""
        sorted_ids, order, values, meta = self._tables[table]
        ids = np.ascontiguousarray(ids, np.int64)
        out = initial_rows(ids, meta["dim"], meta.get("init", {}))
        at = np.minimum(np.searchsorted(sorted_ids, ids), max(len(sorted_ids) - 1, 0))
        found = sorted_ids[at] == ids if len(sorted_ids) else np.zeros(len(ids), bool)
        out[found] = values[order[at[found]]]
        return out

    def lookup_many(self, lookups: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        return [self.lookup(table, ids) for table, ids in lookups]


def _sorted(saved: SavedTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    order = np.argsort(saved.ids, kind="stable")
    return saved.ids[order], order, saved.arrays["values"], saved.meta


def load_into(model: torch.nn.Module, source: RestoreSource) -> None:
    """Load checkpoint `source` into `model`: dense values by name, embedding tables as local
    lookups. Raises CheckpointError naming what does not fit (the model is then unchanged, or
    changed in its dense values only when a table does not fit)."""
    state, _, unknown = named_state(model, dense_values(source), f"checkpoint {source.name}")
    if unknown:
        raise CheckpointError(unknown_message(f"checkpoint {source.name}", unknown))
    model.load_state_dict({**model.state_dict(), **state})
    tables = {}
    for table, meta in source.tables.items():
        ids, rows = table_rows(source, table)
        tables[table] = SavedTable(meta, ids, {"values": _in_order(ids, rows, meta["dim"])})
    attach_tables(model, tables, source.name)


def dense_values(source: RestoreSource) -> dict[str, torch.Tensor]:
    """The checkpoint's dense values under their exported names (float32, as a PS holds them)."""
    values = {var: v.value for info in source.dense_variables().values() for var, v in info["vars"].items()}
    for var, value in values.items():
        if value.dtype != np.float32:
            raise CheckpointError(f"checkpoint {source.name}: variable {var!r} is {value.dtype}, not float32")
    return {name: torch.from_numpy(np.array(values[var])) for var, name in export_names(list(values)).items()}


def table_rows(source: RestoreSource, table: str) -> tuple[np.ndarray, Iterator[tuple[np.ndarray, np.ndarray]]]:
    """A checkpoint table's ids (the rows current at the checkpoint, in its files' order) and an
    iterator of its (ids, float32 rows) slices in that order. Nothing is allocated from the
    metadata's word: the ids are those the files hold (8 bytes a row), and a count the metadata
    says that differs is a CheckpointError naming both."""
    files = source.table_files(table)
    ids = np.concatenate(
        [np.zeros(0, np.int64)] + [chunk for index in files for chunk, _ in source.table_slices(table, index, [])]
    )
    said = source.tables[table]["rows"]
    if said != ids.shape[0]:
        raise CheckpointError(
            f"checkpoint {source.name}: table {table!r} says {said} rows, its files hold {ids.shape[0]}"
        )
    rows = (
        (chunk, arrays["values"]) for index in files for chunk, arrays in source.table_slices(table, index, ["values"])
    )
    return ids, rows


def _in_order(ids: np.ndarray, rows: Iterator[tuple[np.ndarray, np.ndarray]], dim: int) -> np.ndarray:
    """The rows of `ids`, in their order, from `table_rows`' slices."""
    values = np.empty((ids.shape[0], dim), np.float32)
    at = 0
    for chunk, chunk_rows in rows:
        if not np.array_equal(chunk, ids[at : at + chunk.shape[0]]):
            raise CheckpointError("a checkpoint's rows changed while they were read")
        values[at : at + chunk.shape[0]] = chunk_rows
        at += chunk.shape[0]
    if at != ids.shape[0]:
        raise CheckpointError("a checkpoint's rows changed while they were read")
    return values


def named_state(
    model: torch.nn.Module, exported: dict[str, torch.Tensor], where: str
) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """(values by the model's own names, the model's parameters they lack, the exported names the
    model has no parameter of) from values by their exported names (`paramserver checkpoint
    export`'s). A shape that differs is a CheckpointError naming it (`where` names their source).
    Embedding placeholders are not parameters a file holds: their tables are matched apart."""
    names = [name for name, _ in model.named_parameters()]
    own = model.state_dict()
    state, unknown = {}, []
    for key, value in exported.items():
        name = _model_name(key, names)
        if name not in own:
            unknown.append(key)
            continue
        if tuple(own[name].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{where}: variable {key!r} has shape {tuple(value.shape)}, "
                f"the model's {name!r} {tuple(own[name].shape)}"
            )
        state[name] = value
    placeholders = {
        f"{path}.placeholder" if path else "placeholder"
        for path, module in model.named_modules()
        if isinstance(module, HashEmbedding)
    }
    missing = [name for name in names if name not in state and name not in placeholders]
    return state, missing, unknown


def unknown_message(where: str, unknown: list[str]) -> str:
    return f"{where}: the model has no parameter {_few(unknown)} (a checkpoint of another model?)"


def missing_message(where: str, missing: list[str]) -> str:
    return f"{where} lacks the model's parameter(s) {_few(missing)} (strict=False loads without them)"


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _model_name(exported: str, names: list[str]) -> str:
    """`paramN` (an optimizer given model.parameters()) is the model's N-th parameter."""
    match = _POSITIONAL.match(exported)
    if match and exported not in names and int(match.group(1)) < len(names):
        return names[int(match.group(1))]
    return exported


def attach_tables(model: torch.nn.Module, tables: dict[str, SavedTable], checkpoint: str) -> None:
    """Point every HashEmbedding of `model` at its table's saved rows; each saved table must
    belong to one of them."""
    rows = SavedRows(tables)
    dims = {name: saved.meta["dim"] for name, saved in tables.items()}
    for module, table in match_tables(model, dims, f"checkpoint {checkpoint}"):
        module.attach(rows, table)


def match_tables(model: torch.nn.Module, dims: dict[str, int], where: str) -> list[tuple[HashEmbedding, str]]:
    """(module, table) for every HashEmbedding of `model`, from the saved tables' dims by name: each
    module must find its table, of its dim, and each table its module (CheckpointError otherwise)."""
    matched, lacking, unused = find_tables(model, dims, where)
    if lacking:
        raise CheckpointError(
            f"{where} has no table for the model's HashEmbedding {lacking[0][0]!r} (it holds {sorted(dims)})"
        )
    if unused:
        raise CheckpointError(f"{where}: table(s) {unused} match no HashEmbedding of the model")
    return matched


def find_tables(
    model: torch.nn.Module, dims: dict[str, int], where: str
) -> tuple[list[tuple[HashEmbedding, str]], list[tuple[str, HashEmbedding]], list[str]]:
    """(module, table) for every HashEmbedding of `model` that finds its saved table by name (of
    its dim: CheckpointError otherwise), the (path, module) of those that find none, and the
    tables no module finds."""
    modules = [(path, module) for path, module in model.named_modules() if isinstance(module, HashEmbedding)]
    positions = {id(param): index for index, param in enumerate(model.parameters())}
    matched, lacking = {}, []
    for path, module in modules:
        table = _table_of(module, path, positions.get(id(module.placeholder)), dims)
        if table is None:
            lacking.append((path, module))
            continue
        if dims[table] != module.dim:
            raise CheckpointError(f"{where}: table {table!r} has dim {dims[table]}, the model's {path!r} {module.dim}")
        matched[path] = (module, table)
    unused = sorted(set(dims) - {table for _, table in matched.values()})
    return list(matched.values()), lacking, unused


def _table_of(module: HashEmbedding, path: str, position: int | None, tables: dict) -> str | None:
    """The saved table of `module`: its own `name=`, else the one named after its path (`<path>` as
    exported, `optK.<path>` as the optimizer named it) or its position among the model's parameters
    (`paramN`, `optK.paramN`)."""
    if module.table_name in tables:
        return module.table_name
    wanted = {path, f"param{position}"} if position is not None else {path}
    found = [name for name in tables if _OPTIMIZER_PREFIX.sub("", name, count=1) in wanted]
    return found[0] if len(found) == 1 else None
