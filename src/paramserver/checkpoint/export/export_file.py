"""An export file (whole, or a delta since a checkpoint) opened for reading, every part checked
before it is used: what serving loads, and what `load_export`/`load_delta` read.

A file handed to serving is data from anywhere, so it is checked as restore checks a checkpoint:
the safetensors header against the file's size (tensor_file.py: nothing is allocated from a count
the file cannot hold), the metadata's fields (format, step, checkpoint names, lineage), every
tensor's name, dtype and shape (float32 values, int64 ids, one weight row per id, `deleted` only
in a delta) before any data is read; values are then read a slice at a time and refused when
they are NaN or infinite (unless `allow_non_finite`). Ids are checked distinct where they are
sorted (nn/served_rows.py). Each problem is a CheckpointError naming the file and what is wrong.

Lineage: a file names the checkpoint it holds (`checkpoint`, `checkpoint_sha256`: the SHA-256 of
that checkpoint's MANIFEST.json, `run_id`: the run that wrote it); a delta names its base the
same way (`since`, `since_sha256`, `since_run_id`), so that a served model takes a delta only
when it serves exactly that base (serving/loading.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO

import numpy as np

from paramserver.base import kernels
from paramserver.checkpoint.files.tensor_file import TensorReader, TensorSpec
from paramserver.checkpoint.store import CheckpointError, is_checkpoint_name

EXPORT_FORMAT = "paramserver-export"
DELTA_FORMAT = "paramserver-export-delta"
EMBEDDINGS = "embeddings"  # tensor names of a table: embeddings/<table>/ids, .../weight (and .../deleted)
SLICE_BYTES = 8 << 20  # bytes of values read at a time
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_RUN_ID = re.compile(r"^[0-9A-Za-z_.-]{1,64}$")  # a manifest's run_id (worker/recovery/lineage.py makes uuid4 hex)
_STEP = re.compile(r"^[0-9]{1,18}$")


@dataclass(frozen=True)
class Lineage:
    """Which checkpoint a model serves or a file holds: its name, the SHA-256 of its MANIFEST.json
    and its run's id ("" where a file written before lineage was recorded does not say)."""

    checkpoint: str
    sha256: str = ""
    run_id: str = ""

    def describe(self) -> str:
        return f"{self.checkpoint} (sha256 {self.sha256[:12] or 'unknown'}, run {self.run_id or 'unknown'})"

    def metadata(self, prefix: str) -> dict[str, str]:
        """As a file's metadata: `checkpoint`... for prefix "", `since`... for "since"."""
        name = "checkpoint" if not prefix else prefix
        run = "run_id" if not prefix else f"{prefix}_run_id"
        sha = "checkpoint_sha256" if not prefix else f"{prefix}_sha256"
        return {name: self.checkpoint, sha: self.sha256, run: self.run_id}


class ExportFile:
    """An export (`file_format` EXPORT_FORMAT) or delta export (DELTA_FORMAT) at `path`, its header,
    metadata and tensor layout checked when opened (see the module docstring). A context manager;
    not thread-safe (one handle)."""

    def __init__(self, path: str, file_format: str, allow_non_finite: bool = False) -> None:
        self.path, self.format, self.allow_non_finite = str(path), file_format, allow_non_finite
        self.delta = file_format == DELTA_FORMAT
        try:
            self._handle: IO[bytes] = open(self.path, "rb")
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open it ({exc.strerror or exc})") from None
        try:
            size = os.fstat(self._handle.fileno()).st_size
            self._reader = TensorReader(self._handle, size, self.path)
            self._read_metadata(self._reader.metadata)
            self.dense, self.tables = self._layout(self._reader.tensors)
        except BaseException:
            self._handle.close()
            raise

    def __enter__(self) -> ExportFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._handle.close()

    # ---- what the header says -------------------------------------------------------------------
    def _read_metadata(self, metadata: dict[str, str]) -> None:
        what = "delta export" if self.delta else "export"
        if metadata.get("format") != self.format:
            raise CheckpointError(f"{self.path} is not a paramserver {what} (format {metadata.get('format')!r})")
        self.step = self._step(metadata, "step")
        self.lineage = self._lineage(metadata, "", required=self.delta)
        if self.delta:
            self.since_step = self._step(metadata, "since_step")
            self.since = self._lineage(metadata, "since", required=True)

    def _step(self, metadata: dict[str, str], key: str) -> int:
        text = metadata.get(key)
        if text is None or not _STEP.match(text):
            raise CheckpointError(f"{self.path}: its metadata's {key} is {_shown(text)}, not a step count")
        return int(text)

    def _lineage(self, metadata: dict[str, str], prefix: str, required: bool) -> Lineage:
        """The checkpoint named by the metadata (see `Lineage.metadata`); its hash and run id may be
        absent only from a whole export written before they were recorded (not `required`)."""
        name_key, sha_key, run_key = Lineage("").metadata(prefix)
        name, sha, run = metadata.get(name_key), metadata.get(sha_key), metadata.get(run_key)
        if not is_checkpoint_name(name):
            raise CheckpointError(f"{self.path}: its metadata's {name_key} is {_shown(name)}, not a checkpoint name")
        if required and (not sha or run is None):
            raise CheckpointError(
                f"{self.path}: its metadata names no {run_key if sha else sha_key} "
                "(a delta must name the exact checkpoint and run it applies to; export it again)"
            )
        if sha and not _SHA256.match(sha):
            raise CheckpointError(f"{self.path}: its metadata's {sha_key} is {_shown(sha)}, not a SHA-256")
        if run and not is_run_id(run):
            raise CheckpointError(f"{self.path}: its metadata's {run_key} is {_shown(run)}, not a run id")
        return Lineage(str(name), sha or "", run or "")

    def _layout(self, tensors: dict[str, TensorSpec]) -> tuple[dict[str, TensorSpec], dict[str, dict[str, TensorSpec]]]:
        """Dense tensors by name and each table's tensors by field, every dtype and shape checked."""
        dense: dict[str, TensorSpec] = {}
        tables: dict[str, dict[str, TensorSpec]] = {}
        for key, spec in tensors.items():
            if key.startswith(f"{EMBEDDINGS}/"):
                table, _, field = key[len(EMBEDDINGS) + 1 :].rpartition("/")
                tables.setdefault(table, {})[field] = spec
            elif spec.dtype != np.float32:
                raise CheckpointError(f"{self.path}: variable {key!r} is {spec.dtype}, not float32 (what a PS holds)")
            else:
                dense[key] = spec
        for table, fields in tables.items():
            self._check_table(table, fields)
        return dense, tables

    def _check_table(self, table: str, fields: dict[str, TensorSpec]) -> None:
        wanted = {"ids", "weight", "deleted"} if self.delta else {"ids", "weight"}
        if not table or set(fields) != wanted:
            raise CheckpointError(f"{self.path}: table {table!r} has tensors {sorted(fields)}, not {sorted(wanted)}")
        ids, weight = fields["ids"], fields["weight"]
        for field in wanted - {"weight"}:
            if fields[field].dtype != np.int64 or len(fields[field].shape) != 1:
                raise CheckpointError(
                    f"{self.path}: table {table!r} {field} are {fields[field].dtype} of shape "
                    f"{fields[field].shape}, not 1-D int64"
                )
        if weight.dtype != np.float32 or len(weight.shape) != 2 or weight.shape[1] < 1:
            raise CheckpointError(
                f"{self.path}: table {table!r} weight is {weight.dtype} of shape {weight.shape}, not float32 rows"
            )
        if weight.shape[0] != ids.shape[0]:
            raise CheckpointError(
                f"{self.path}: table {table!r} has {ids.shape[0]} ids for {weight.shape[0]} weight rows"
            )

    def dims(self) -> dict[str, int]:
        return {table: fields["weight"].shape[1] for table, fields in self.tables.items()}

    def rows(self, table: str) -> int:
        return self.tables[table]["ids"].shape[0]

    # ---- reading --------------------------------------------------------------------------------
    def dense_values(self) -> dict[str, np.ndarray]:
        """Every dense variable (float32, finite unless allowed); dense variables are small."""
        out = {}
        for name in self.dense:
            values = self._reader.read(name)
            self._check_finite(values, f"variable {name!r}")
            out[name] = values
        return out

    def ids(self, table: str, field: str = "ids") -> np.ndarray:
        """A table's ids (or its deleted ids), whole: 8 bytes a row, their count checked against
        the file's size when it was opened."""
        return self._reader.read(f"{EMBEDDINGS}/{table}/{field}")

    def id_slices(self, table: str, field: str) -> Iterator[np.ndarray]:
        """A table's ids (or deleted ids), SLICE_BYTES at a time."""
        rows = self.tables[table][field].shape[0]
        for lo in range(0, rows, SLICE_BYTES // 8):
            yield self._reader.read(f"{EMBEDDINGS}/{table}/{field}", lo, lo + SLICE_BYTES // 8)

    def rows_slices(self, table: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, weight rows) of a table, a slice at a time, in the file's order."""
        for lo, rows in self.weight_slices(table):
            yield self._reader.read(f"{EMBEDDINGS}/{table}/ids", lo, lo + rows.shape[0]), rows

    def weight_slices(self, table: str) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, rows) of a table's weight, SLICE_BYTES at a time, each finite unless allowed."""
        name = f"{EMBEDDINGS}/{table}/weight"
        spec = self.tables[table]["weight"]
        step = max(1, SLICE_BYTES // max(1, spec.row_bytes))
        for lo in range(0, spec.shape[0], step):
            rows = self._reader.read(name, lo, lo + step)
            self._check_finite(rows, f"table {table!r}")
            yield lo, rows

    def _check_finite(self, values: np.ndarray, what: str) -> None:
        if not self.allow_non_finite and not kernels.all_finite(values):
            raise CheckpointError(
                f"{self.path}: {what} holds NaN or infinite values (allow_non_finite=True serves them)"
            )


def is_run_id(text: object) -> bool:
    return isinstance(text, str) and _RUN_ID.match(text) is not None


def sorted_rows(
    ids: np.ndarray, slices: Iterable[tuple[np.ndarray, np.ndarray]], dim: int, where: str, spare_row: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Rows by id: `ids` sorted, and their float32 rows in that order, from `slices` of (ids, rows)
    that give the rows of `ids` in `ids`' order (with one zero row after them if `spare_row`: a
    served table's row for unknown ids). Each row is written once, into its place: no second copy
    of the rows. An id twice, or slices that do not give one row of `dim` per id in that order, is
    a CheckpointError naming `where`."""
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    check_distinct(sorted_ids, where)
    position = np.empty_like(order)
    position[order] = np.arange(order.shape[0])
    del order
    weight = np.empty((ids.shape[0] + int(spare_row), dim), np.float32)
    weight[ids.shape[0] :] = 0
    at = 0
    for chunk_ids, rows in slices:
        count = chunk_ids.shape[0]
        if rows.shape != (count, dim) or not np.array_equal(chunk_ids, ids[at : at + count]):
            raise CheckpointError(f"{where}: its rows do not follow its ids (the file changed while it was read?)")
        weight[position[at : at + count]] = rows
        at += count
    if at != ids.shape[0]:
        raise CheckpointError(f"{where}: {at} rows for {ids.shape[0]} ids")
    return sorted_ids, weight


def check_distinct(sorted_ids: np.ndarray, where: str) -> None:
    """Sorted ids name each id once (a table holds one row per id)."""
    twice = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
    if twice.shape[0]:
        raise CheckpointError(f"{where} names id {int(sorted_ids[twice[0]])} twice ({twice.shape[0]} repeats)")


def _shown(value: object) -> str:
    return "missing" if value is None else repr(str(value)[:80])
