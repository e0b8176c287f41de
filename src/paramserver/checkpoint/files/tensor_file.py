"""Safetensors files written and read a piece at a time, so that no whole table is ever in memory.

The layout is safetensors' own (``safetensors.numpy.load_file`` and ``safe_open`` read our
files): 8 bytes of header length (little-endian), a JSON header naming each tensor's dtype,
shape and byte range in the data that follows, and an optional ``__metadata__`` of strings.
`plan` fixes every tensor's range before any data exists, so a writer can put a block of rows of
any tensor at its place (`TensorPlan.offset`); `TensorReader` reads any rows of any tensor.

Nothing read is trusted: the header's length, every dtype, shape and range are checked against
the file's size before anything is read or allocated for it (`TensorFileError` names the file
and what is wrong).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from paramserver.checkpoint.store import CheckpointError

DTYPES = {
    "F32": np.float32,
    "F64": np.float64,
    "F16": np.float16,
    "BF16": np.uint16,  # numpy has no bfloat16: its bits (checkpoint/files/quantize.py)
    "I64": np.int64,
    "I32": np.int32,
    "I8": np.int8,
    "U8": np.uint8,
}
_CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}
_U8 = np.dtype(np.uint8)
MAX_HEADER = 64 << 20  # header bytes a reader accepts: far above any real checkpoint's


class TensorFileError(CheckpointError):
    """A file that is not a well-formed safetensors file (names the file and the problem)."""


@dataclass(frozen=True)
class TensorSpec:
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int  # byte offset from the start of the file
    nbytes: int

    @property
    def row_bytes(self) -> int:
        """Bytes of one entry along axis 0 (a row of a table, a row of a dense variable)."""
        return self.dtype.itemsize * math.prod(self.shape[1:])


@dataclass(frozen=True)
class TensorPlan:
    """Where every tensor of a file to be written goes; `header` is the file's first bytes."""

    header: bytes
    tensors: dict[str, TensorSpec]
    size: int  # bytes of the whole file

    def offset(self, name: str, row: int) -> int:
        """Byte offset in the file of row `row` (along axis 0) of tensor `name`."""
        spec = self.tensors[name]
        return spec.start + row * spec.row_bytes


def plan(tensors: dict[str, tuple[np.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> TensorPlan:
    """Lay out tensors (name -> (dtype, shape)), in the order given, after a header."""
    entries: dict[str, Any] = {"__metadata__": metadata}
    ranges, at = {}, 0
    for name, (dtype, shape) in tensors.items():
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize * math.prod(shape)
        entries[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [at, at + nbytes]}
        ranges[name] = (dtype, tuple(shape), at, nbytes)
        at += nbytes
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # safetensors pads the header so the data starts aligned
    header = len(body).to_bytes(8, "little") + body
    specs = {name: TensorSpec(dtype, shape, len(header) + lo, n) for name, (dtype, shape, lo, n) in ranges.items()}
    return TensorPlan(header, specs, len(header) + at)


def write_rows(handle: IO[bytes], layout: TensorPlan, name: str, row: int, array: np.ndarray) -> None:
    """Write `array` (rows of tensor `name`, from row `row` on) at its place in the file; a
    TensorFileError for rows of another dtype or row shape, or past the tensor's end (they would
    land in another tensor's bytes)."""
    array = np.ascontiguousarray(array)
    spec = layout.tensors[name]
    rows = spec.shape[0] if spec.shape else 1
    fits = array.shape[1:] == spec.shape[1:] and 0 <= row and row + (array.shape[0] if array.shape else 1) <= rows
    if array.dtype != spec.dtype or not (fits or array.shape == spec.shape):
        raise TensorFileError(
            f"tensor {name!r}: rows {row}.. of {array.dtype} {array.shape} do not fit "
            f"a {spec.dtype} tensor of {spec.shape}"
        )
    if array.nbytes:
        handle.seek(layout.offset(name, row))
        handle.write(array.reshape(-1).view(np.uint8).data)


class TensorReader:
    """The tensors of one safetensors file on an open binary handle (seek + read), checked.

    Not thread-safe (one handle, one position)."""

    def __init__(self, handle: IO[bytes], size: int, where: str, tensors: dict[str, TensorSpec] | None = None) -> None:
        """`tensors`: the file's tensors as a reader of the same bytes found them (the header is then
        not read again; no metadata)."""
        self.handle, self.where = handle, where
        self.metadata: dict[str, str] = {}
        if tensors is not None:
            self.tensors = tensors
        else:
            self.metadata, self.tensors = _parse_header(handle, size, where)

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows lo..hi (axis 0) of tensor `name`, a fresh writable array."""
        spec = self.tensors.get(name)
        if spec is None:
            raise TensorFileError(f"{self.where}: no tensor {name!r}")
        rows = spec.shape[0] if spec.shape else 1
        hi = rows if hi is None else min(hi, rows)
        lo = min(max(lo, 0), hi)
        out = np.empty(((hi - lo),) + spec.shape[1:] if spec.shape else (), spec.dtype)
        self.handle.seek(spec.start + lo * spec.row_bytes)
        view = out.reshape(-1).view(np.uint8).data
        got = 0
        while got < out.nbytes:
            n = self.handle.readinto(view[got:]) if hasattr(self.handle, "readinto") else None
            if n is None:  # a file object without readinto (some fsspec ones)
                data = self.handle.read(out.nbytes - got)
                n = len(data)
                view[got : got + n] = data
            if not n:
                raise TensorFileError(f"{self.where}: ends inside tensor {name!r}")
            got += n
        return out


def _parse_header(handle: IO[bytes], size: int, where: str) -> tuple[dict[str, str], dict[str, TensorSpec]]:
    handle.seek(0)
    head = handle.read(8)
    if len(head) < 8:
        raise TensorFileError(f"{where}: not a safetensors file ({size} bytes)")
    length = int.from_bytes(head, "little")
    if length > min(MAX_HEADER, size - 8):
        raise TensorFileError(f"{where}: header of {length} bytes does not fit a {size}-byte file")
    try:
        header = json.loads(handle.read(length))
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
        raise TensorFileError(f"{where}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{where}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise TensorFileError(f"{where}: __metadata__ is not a map of strings")
    data_size = size - 8 - length
    tensors = {name: _spec(name, entry, 8 + length, data_size, where) for name, entry in header.items()}
    end = 8 + length
    for name, spec in sorted(tensors.items(), key=lambda item: item[1].start):
        if spec.start < end:  # two tensors sharing bytes: a writer of ours never makes that
            raise TensorFileError(f"{where}: tensor {name!r} overlaps the one before it")
        end = spec.start + spec.nbytes
    return metadata, tensors


def scan(
    handle: IO[bytes], size: int, tensors: dict[str, TensorSpec], chunk: int, where: str
) -> Iterator[tuple[str | None, bytes]]:
    """The whole file from its first byte to `size`, in order, as (tensor name or None, bytes):
    each tensor's bytes in pieces of whole elements (at most `chunk` bytes), None for the header
    and any gaps. For one pass that hashes a file and checks its values. Raises TensorFileError
    when the file ends early."""
    handle.seek(0)
    at = 0
    ordered = sorted(tensors.items(), key=lambda item: item[1].start)
    for name, spec in [*ordered, (None, TensorSpec(_U8, (0,), size, 0))]:
        if spec.start > at:
            yield None, _read_exactly(handle, spec.start - at, f"{where}: ends before {name or 'its size'}")
            at = spec.start
        step = max(spec.dtype.itemsize, chunk - chunk % spec.dtype.itemsize)
        for lo in range(0, spec.nbytes, step):
            yield name, _read_exactly(handle, min(step, spec.nbytes - lo), f"{where}: ends inside tensor {name!r}")
        at += spec.nbytes


def _read_exactly(handle: IO[bytes], n: int, problem: str) -> bytes:
    data = handle.read(n)
    if len(data) != n:
        raise TensorFileError(problem)
    return data


def _spec(name: str, entry: Any, data_start: int, data_size: int, where: str) -> TensorSpec:
    try:
        dtype = np.dtype(DTYPES[entry["dtype"]])
        shape = tuple(entry["shape"])
        lo, hi = entry["data_offsets"]
        ok = all(type(n) is int and n >= 0 for n in (*shape, lo, hi))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise TensorFileError(f"{where}: tensor {name!r} has a malformed entry {str(entry)[:120]}")
    nbytes = dtype.itemsize * math.prod(shape)
    if hi - lo != nbytes or hi > data_size:
        raise TensorFileError(
            f"{where}: tensor {name!r} of shape {shape} ({nbytes} bytes) does not match its range "
            f"[{lo}, {hi}) of {data_size} data bytes"
        )
    return TensorSpec(dtype, shape, data_start + lo, nbytes)
