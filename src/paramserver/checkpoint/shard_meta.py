"""The typed schema of a shard file's metadata, and its agreement with the file's tensors.

A checkpoint is data, never instructions: a shard file's metadata (JSON under the ``paramserver``
key, written by shard_file.py) is validated whole, strictly (no coercion: a string is not a number,
``true`` is not 1), before any of it is used. Then the tensors it names are checked against it:
every dense part and its optimizer state has a tensor of one shape, a part named ``var[lo:hi]``
holds hi - lo rows, and every table has its ids. That parts tile their variables is checked
across files (restore.py), since a variable may be split over shards.

`parse` raises a CheckpointError naming the file, the field and what is wrong.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError
from pydantic import StringConstraints as Text

from . import quantize
from .store import CheckpointError
from .tensor_file import TensorSpec

# Names reach log lines, metric labels and files: printable, no control characters, no lone surrogates
_PRINTABLE = r"^[^\x00-\x1f\x7f\ud800-\udfff]+$"
Name = Annotated[str, Text(min_length=1, max_length=256, pattern=_PRINTABLE)]
WorkerKey = Annotated[str, Text(pattern=r"^\d{1,9}$")]
CheckpointName = Annotated[str, Text(pattern=r"^ckpt-\d{9}$")]
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
    except ValueError as exc:  # ValidationError is one
        raise CheckpointError(f"{where}: metadata is malformed ({_first_problem(exc)})") from None
    for group, info in meta.groups.items():
        for part in info.steps:
            _check_part(tensors, f"dense/{group}/{part}", part, where)
    for table, table_meta in meta.tables.items():
        ids = tensors.get(f"table/{table}/ids")
        if ids is None or ids.dtype != np.int64 or len(ids.shape) != 1:
            raise CheckpointError(f"{where}: table {table!r} has no 1-D int64 ids tensor")
        if meta.parent is None and table_meta.rows is not None and table_meta.rows != ids.shape[0]:
            raise CheckpointError(f"{where}: table {table!r} says {table_meta.rows} rows and holds {ids.shape[0]}")
        _check_encoding(tensors, table, table_meta, ids.shape[0], where)
        deleted = tensors.get(f"table/{table}/deleted")
        if meta.parent is not None and (deleted is None or deleted.dtype != np.int64 or len(deleted.shape) != 1):
            raise CheckpointError(f"{where}: table {table!r} of a delta has no 1-D int64 deleted tensor")
    return meta.model_dump()


def _check_encoding(tensors: dict[str, TensorSpec], table: str, meta: TableMeta, rows: int, where: str) -> None:
    """A quantized table's values (and int8's scales) are of the dtype and shape its encoding says."""
    if meta.encoding == "float32":
        return  # checked against the table's layout where it is restored
    for name, (dtype, row_shape) in quantize.layout(meta.encoding, (meta.dim,)).items():
        spec = tensors.get(f"table/{table}/{name}")
        if spec is None or spec.dtype != dtype or spec.shape != (rows, *row_shape):
            found = f"{spec.dtype} of shape {spec.shape}" if spec is not None else "missing"
            raise CheckpointError(
                f"{where}: table {table!r} is {meta.encoding}-encoded, its {name} must be {dtype} of shape "
                f"{(rows, *row_shape)}, not {found}"
            )


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


def _first_problem(exc: ValueError) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])[:160].encode("ascii", "backslashreplace").decode()
        return f"{where}: {first['msg']}" + (f" ({exc.error_count()} problems)" if exc.error_count() > 1 else "")
    return str(exc)[:200]
