"""The typed schema of a shard file's metadata, and its agreement with the file's tensors.

A checkpoint is data, never instructions: a shard file's metadata (JSON under the ``paramserver``
key, written by shard_file.py) is validated whole, strictly (no coercion: a string is not a number,
``true`` is not 1), before any of it is used. Then the tensors it names are checked against it:
every dense part and its optimizer state has a tensor of one shape, a part named ``var[lo:hi]``
holds hi - lo rows, and every table has 1-D int64 ids, one row of each of its tensors per id, of
the dtypes and row shapes its optimizer, row policy and encoding (quantize.py) make. That parts
tile their variables is checked across files (restore.py), since a variable may be split over
shards.

`parse` raises a CheckpointError naming the file, the field and what is wrong.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError
from pydantic import StringConstraints as Text

from paramserver.base import names
from paramserver.base.errors import InvalidArgumentError
from paramserver.checkpoint.files import quantize
from paramserver.checkpoint.files.tensor_file import TensorSpec
from paramserver.checkpoint.store import CheckpointError

# Names obey the one rule a PS applies when they are registered (base/names.py): what it accepts, this reads
Name = Annotated[str, AfterValidator(names.name_value)]
WorkerKey = Annotated[str, Text(pattern=r"^\d{1,9}$")]
CheckpointName = Annotated[str, AfterValidator(names.checkpoint_name_value)]
_PART = re.compile(r"^(.*)\[(\d+):(\d+)\]$")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, regex_engine="python-re")


class GroupMeta(_Strict):
    spec: dict[str, Any]  # the optimizer: {"name": ..., "hyper": {...}}, compared with the model's
    steps: dict[Name, NonNegativeInt]  # part -> updates applied to it


class TableMeta(_Strict):
    dim: PositiveInt
    spec: dict[str, Any]
    counters: dict[Name, NonNegativeInt]
    steps: NonNegativeInt
    init: dict[str, Any] = Field(default_factory=dict)
    policy: dict[str, Any] = Field(default_factory=dict)
    rows: NonNegativeInt | None = None  # rows the table held (a delta's file holds fewer); absent in older files
    encoding: Literal["float32", "bf16", "int8"] = "float32"  # how `values` is stored (quantize.py)
    shards: PositiveInt | None = None  # the shards its ids were routed over when written; absent in older files


class ShardMeta(_Strict):
    shard: NonNegativeInt
    version: NonNegativeInt = 0
    sync_step: int = 0
    groups: dict[Name, GroupMeta]
    tables: dict[Name, TableMeta]
    positions: dict[WorkerKey, NonNegativeInt]  # worker -> steps it had trained
    parent: CheckpointName | None = None  # a delta: the checkpoint whose rows it changes


def parse(text: str | None, tensors: dict[str, TensorSpec], where: str) -> dict[str, Any]:
    """The metadata `text` of a shard file whose tensors are `tensors`, validated (the schema,
    then its agreement with the tensors); as plain dicts."""
    if text is None:
        raise CheckpointError(f"{where}: not a paramserver shard file (no metadata)")
    try:
        meta = ShardMeta.model_validate(json.loads(text))
    except (ValueError, RecursionError) as exc:  # ValidationError is a ValueError; RecursionError: nested too deep
        raise CheckpointError(f"{where}: metadata is malformed ({_first_problem(exc)})") from None
    for group, info in meta.groups.items():
        for part in info.steps:
            _check_part(tensors, f"dense/{group}/{part}", part, where)
    for table, table_meta in meta.tables.items():
        _check_table(tensors, table, table_meta, meta.parent is not None, where)
    return meta.model_dump()


def row_layout(dim: int, spec: dict[str, Any], policy: dict[str, Any]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """What a saved row of a table of `dim`, optimizer `spec` and row `policy` holds (as the
    table's own `layout()`, ids aside): "values", each optimizer state, "row_step" when the
    optimizer counts per row, "last_seen" and "seen" when an eviction rule needs them.
    InvalidArgumentError for a spec or policy no table can have."""
    from paramserver.tables.embedding_table import RowPolicy  # here: the server's tables define what a row holds
    from paramserver.tables.sparse_optimizers import build_sparse_optimizer

    f32, i64 = np.dtype(np.float32), np.dtype(np.int64)
    optimizer = build_sparse_optimizer(spec)
    found: dict[str, tuple[np.dtype, tuple[int, ...]]] = {"values": (f32, (dim,))}
    found.update({key: (f32, (dim,)) for key in optimizer.state_init()})
    if optimizer.hyper.get("per_row_step"):
        found["row_step"] = (i64, ())
    row_policy = RowPolicy.from_dict(policy)
    if row_policy.ttl_steps or row_policy.min_count or row_policy.max_rows:
        found.update(last_seen=(i64, ()), seen=(i64, ()))
    return found


def _check_table(tensors: dict[str, TensorSpec], table: str, meta: TableMeta, delta: bool, where: str) -> None:
    """A table's tensors agree with its metadata: 1-D int64 ids, every other row tensor one row per
    id, those of its layout (from its optimizer and policy) of their dtypes and row shapes, its
    values in its encoding (quantize.py), and a delta's 1-D int64 deleted ids."""
    ids = tensors.get(f"table/{table}/ids")
    if ids is None or ids.dtype != np.int64 or len(ids.shape) != 1:
        raise CheckpointError(f"{where}: table {table!r} has no 1-D int64 ids tensor")
    rows = ids.shape[0]
    if not delta and meta.rows is not None and meta.rows != rows:
        raise CheckpointError(f"{where}: table {table!r} says {meta.rows} rows and holds {rows}")
    mine = {  # this table's own tensors (a table named "t/x" holds table/t/x/..., not t's)
        key[len(f"table/{table}/") :]: spec
        for key, spec in tensors.items()
        if key.startswith(f"table/{table}/") and "/" not in key[len(f"table/{table}/") :]
    }
    try:
        layout = row_layout(meta.dim, meta.spec, meta.policy)
    except InvalidArgumentError as exc:
        raise CheckpointError(f"{where}: table {table!r} has an optimizer or row policy no table has ({exc})") from None
    for name, spec in mine.items():
        if name in ("ids", "deleted", "values", quantize.SCALE):
            continue  # the values are their encoding's to check (quantize.py)
        if not spec.shape or spec.shape[0] != rows:
            raise CheckpointError(f"{where}: table {table!r} holds {rows} ids and {name} of shape {spec.shape}")
        if name in layout and (spec.dtype, spec.shape[1:]) != layout[name]:
            dtype, row_shape = layout[name]
            raise CheckpointError(
                f"{where}: table {table!r} {name} is {spec.dtype} rows of {spec.shape[1:]}, "
                f"not {dtype} rows of {row_shape}"
            )
    problem = quantize.layout_problem(meta.encoding, meta.dim, {n: (s.dtype, s.shape) for n, s in mine.items()}, rows)
    if problem is not None:
        raise CheckpointError(f"{where}: table {table!r} {problem}")
    deleted = mine.get("deleted")
    if delta and (deleted is None or deleted.dtype != np.int64 or len(deleted.shape) != 1):
        raise CheckpointError(f"{where}: table {table!r} of a delta has no 1-D int64 deleted tensor")


def _check_part(tensors: dict[str, TensorSpec], name: str, part: str, where: str) -> None:
    values = tensors.get(name)
    if values is None or values.dtype.kind != "f":
        raise CheckpointError(f"{where}: dense part {name!r} has no floating-point tensor")
    match = _PART.match(part)
    if match and (not values.shape or values.shape[0] != int(match.group(3)) - int(match.group(2))):
        raise CheckpointError(f"{where}: dense part {name!r} holds {values.shape}, not the rows its name says")
    for key, spec in tensors.items():
        if key.startswith(name + "/") and spec.shape != values.shape:
            raise CheckpointError(f"{where}: optimizer state {key!r} has shape {spec.shape}, its part {values.shape}")


def _first_problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = _printable(".".join(str(part) for part in first["loc"])[:160])
        more = f" ({exc.error_count()} problems)" if exc.error_count() > 1 else ""
        return f"{where}: {_printable(str(first['msg'])[:200])}{more}"
    return _printable(str(exc)[:200])


def _printable(text: str) -> str:
    """`text` with every character outside printable ASCII escaped (a key from a file may hold a
    newline or a terminal escape: an error message stays one line of what the file holds)."""
    return ascii(text)[1:-1]
