"""The binary frame every request and reply travels in.

Layout (all integers little-endian)::

    offset 0   4 bytes   magic b"PSFR"
    offset 4   u16       protocol major version
    offset 6   u16       protocol minor version
    offset 8   u32       header length H
    offset 12  H bytes   header: UTF-8 JSON {"meta": {...}, "tensors": [[name, dtype, shape, offset, nbytes], ...]}
    then       padding to a multiple of 8, then the data section; each tensor's raw bytes
               (C order) start at its offset inside the data section, aligned to 8 bytes.

The header is strict UTF-8: bytes that are not (a surrogate's bytes among them) and JSON escapes of
lone surrogates are refused (MalformedFrameError), so every string a peer sends can be written to a
file and read back (base/names.py says which strings are names). Tensors are never pickled: a
decoder only ever builds read-only numpy views over the received bytes. A peer with another major
version is refused with ProtocolVersionError. Stateless and thread-safe.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paramserver.base.errors import MalformedFrameError, ProtocolVersionError

MAGIC = b"PSFR"
PROTOCOL_MAJOR = 2  # 2: a step's dense parts, row pushes and lookups named by typed fields (PushPull)
# 1: RegisterTable's reply says the worker's data position; 2: checkpoints written in the background;
# 3: pulled values as half precision (PushPull's pull_as)
PROTOCOL_MINOR = 3  # (docs/protocol.md)
_PREFIX = struct.Struct("<4sHHI")
_ALIGN = 8
_MAX_DIMS = 32  # numpy's limit is 64; no variable of this project has more than a few
_INT64 = 1 << 63
# The dtypes a frame may carry, by their numpy names; bfloat16 travels as uint16 bits (wire/half.py),
# int8 carries quantized gradients (base/codecs/int8.py).
DTYPES = frozenset({"float32", "float64", "float16", "int64", "int32", "uint16", "uint8", "int8", "bool"})


@dataclass
class Frame:
    """A decoded frame: free-form metadata plus named read-only arrays."""

    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


def _pad(n: int) -> int:
    return (-n) % _ALIGN


def encode_parts(
    meta: dict[str, Any], tensors: Iterable[tuple[str, np.ndarray]] = (), major: int = PROTOCOL_MAJOR
) -> list:
    """The frame as a list of buffers (prefix+header, then each tensor's bytes), copying nothing.

    A transport joins them or writes them straight into shared memory. The arrays must stay
    unchanged until the parts are sent.
    """
    entries, buffers, offset = [], [], 0
    for name, array in tensors:
        array = np.ascontiguousarray(array)
        nbytes = array.nbytes
        entries.append([name, array.dtype.name, list(array.shape), offset, nbytes])
        buffers.append(array.reshape(-1).data.cast("B") if nbytes else b"")  # .data is memoryview(array)
        pad = _pad(nbytes)
        if pad:
            buffers.append(b"\0" * pad)
        offset += nbytes + pad
    header = json.dumps({"meta": meta, "tensors": entries}, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, major, PROTOCOL_MINOR, len(header))
    head_pad = b"\0" * _pad(len(prefix) + len(header))
    return [prefix + header + head_pad, *buffers]


def encode(meta: dict[str, Any], tensors: Iterable[tuple[str, np.ndarray]] = (), major: int = PROTOCOL_MAJOR) -> bytes:
    """Encode metadata and (name, array) pairs into one frame. Arrays are copied once."""
    return b"".join(encode_parts(meta, tensors, major))


def parts_size(parts: list) -> int:
    return sum(len(memoryview(part).cast("B")) for part in parts)


def split_parts(parts: list, chunk_bytes: int):
    """The bytes of `parts`, in order, as lists of byte views of at most `chunk_bytes` in all (the
    last may be shorter); copies nothing. How a transport cuts a payload past max_message_bytes."""
    piece, room = [], chunk_bytes
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            take = view[:room]
            piece.append(take)
            view, room = view[len(take) :], room - len(take)
            if not room:
                yield piece
                piece, room = [], chunk_bytes
    if piece:
        yield piece


def decode(payload: bytes) -> Frame:
    """Decode a frame, validating every length and dtype. Raises MalformedFrameError."""
    meta, entries, header_end = _header(payload)
    data = memoryview(payload)[header_end + _pad(header_end) :]
    tensors: dict[str, np.ndarray] = {}
    for entry in map(_check_entry, entries):
        if entry[0] in tensors:  # the second would silently replace the first
            raise MalformedFrameError(f"frame names tensor {entry[0][:100]!r} twice")
        tensors[entry[0]] = _tensor(entry, data)
    return Frame(meta, tensors)


def header_bytes(payload) -> int | None:
    """Where a frame's tensor data starts (its prefix, header and padding), read from the prefix at the
    start of `payload`; None when `payload` is shorter than the prefix. Not validated (decode does)."""
    if len(payload) < _PREFIX.size:
        return None
    end = _PREFIX.size + _PREFIX.unpack_from(payload)[3]
    return end + _pad(end)


def float32_spans(payload, size: int) -> list[tuple[int, int]]:
    """(start, bytes) in the frame of each of its float32 tensors, in order, from the frame's first bytes
    `payload` (its header complete); `size`: the whole frame's length. [] where the header is not valid
    or the tensors are not laid out one after another inside the frame (decode refuses or checks those)."""
    try:
        _, entries, header_end = _header(payload)
        entries = [_check_entry(entry) for entry in entries]
    except (MalformedFrameError, ProtocolVersionError):
        return []
    start, spans = header_end + _pad(header_end), []
    at = start
    for _, dtype, _, offset, nbytes in entries:
        if offset + start < at or offset % _ALIGN:
            return []
        at = offset + start + nbytes
        if dtype == "float32" and nbytes and not nbytes % 4:
            spans.append((offset + start, nbytes))
    return spans if at <= size else []


def decode_meta(payload) -> dict[str, Any]:
    """Only a frame's meta, without building its tensors (cheap: for checks before the full decode,
    which still validates the whole frame). Raises MalformedFrameError / ProtocolVersionError."""
    return _header(payload)[0]


def _header(payload) -> tuple[dict, list, int]:
    """(meta, tensor entries, where the header ends) of a frame, its prefix and header checked."""
    if len(payload) < _PREFIX.size:
        raise MalformedFrameError(f"frame of {len(payload)} bytes is shorter than its {_PREFIX.size}-byte prefix")
    magic, major, _minor, header_len = _PREFIX.unpack_from(payload)
    if magic != MAGIC:
        raise MalformedFrameError(f"frame does not start with {MAGIC!r} (got {magic!r})")
    if major != PROTOCOL_MAJOR:
        raise ProtocolVersionError(
            f"peer speaks protocol {major}.x, this node speaks {PROTOCOL_MAJOR}.{PROTOCOL_MINOR}"
        )
    header_end = _PREFIX.size + header_len
    if header_end > len(payload):
        raise MalformedFrameError(f"header length {header_len} runs past the frame's {len(payload)} bytes")
    text = bytes(payload[_PREFIX.size : header_end])
    try:  # strict UTF-8: a surrogate's bytes (ED A0 80) or any other invalid byte is refused
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = text[exc.start : exc.start + 3]
        if _SURROGATE_BYTES.match(bad):
            why = f"a lone surrogate's bytes (U+D800-U+DFFF) at byte {exc.start}{_surrogate_at(text, 'surrogatepass')}"
        else:
            why = f"{exc.reason} at byte {exc.start} ({bad!r})"
        raise MalformedFrameError(f"frame header is not UTF-8 text: {why}") from None
    if _SURROGATE_ESCAPE.search(text):  # names reach files, logs and labels: an escape must make UTF-8 too
        where = _surrogate_at(text, "strict")
        if where:
            raise MalformedFrameError(f"frame header holds a lone surrogate (\\ud800-\\udfff){where}: not UTF-8 text")
    try:
        header = _HEADER_DECODER.decode(decoded)  # NaN and Infinity are not JSON: refused like any other bad header
        meta, entries = header["meta"], header["tensors"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise MalformedFrameError(f"frame header is not valid: {why}") from None
    if not isinstance(meta, dict) or not isinstance(entries, list):
        raise MalformedFrameError("frame header must hold a 'meta' object and a 'tensors' list")
    return meta, entries, header_end


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a JSON escape of a surrogate, paired or not
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")  # how CESU-8 and "surrogatepass" write U+D800-U+DFFF
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # in decoded JSON, where a pair of escapes is one character


def _surrogate_at(text: bytes, errors: str) -> str:
    """Where a header (decoded with `errors`) holds a lone surrogate: " in ['meta']['group']" (a
    string) or " in a key of ['meta']"; "" where it is not JSON or holds none (then it is refused
    as not valid, or not refused)."""
    try:
        stack = [(_HEADER_DECODER.decode(text.decode("utf-8", errors)), "")]
    except (ValueError, RecursionError):
        return ""
    while stack:
        value, where = stack.pop()
        if isinstance(value, str) and _LONE_SURROGATE.search(value):
            return f" in {where}"
        if isinstance(value, dict):
            for key in value:
                if _LONE_SURROGATE.search(key):
                    return f" in a key of {where or 'the header'}"
            stack.extend((value[key], f"{where}[{ascii(key)[:60]}]") for key in reversed(value))  # in order
        elif isinstance(value, list):
            stack.extend((value[at], f"{where}[{at}]") for at in reversed(range(len(value))))
    return ""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


# one decoder for every frame: json.loads with an option builds a new one per call
_HEADER_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def _check_entry(entry: Any) -> list:
    ok = (
        isinstance(entry, list)
        and len(entry) == 5
        and isinstance(entry[0], str)
        and isinstance(entry[1], str)
        and entry[1] in DTYPES
        and isinstance(entry[2], list)
        and len(entry[2]) <= _MAX_DIMS
        and all(type(d) is int and 0 <= d < _INT64 for d in entry[2])
        and all(type(v) is int and 0 <= v < _INT64 for v in entry[3:5])
    )
    if not ok:
        raise MalformedFrameError(f"bad tensor entry in frame header: {str(entry)[:200]}")
    return entry


def _tensor(entry: list, data: memoryview) -> np.ndarray:
    name, dtype_name, shape, offset, nbytes = entry
    dtype = np.dtype(dtype_name)
    count = math.prod(shape)
    if count * dtype.itemsize != nbytes:
        raise MalformedFrameError(
            f"tensor {name[:100]!r}: shape {str(shape)[:100]} of {dtype_name} is not {nbytes} bytes"
        )
    if offset + nbytes > len(data):
        raise MalformedFrameError(f"tensor {name[:100]!r}: bytes {offset}..{offset + nbytes} run past the frame")
    if offset % _ALIGN:
        raise MalformedFrameError(f"tensor {name[:100]!r}: offset {offset} is not aligned to {_ALIGN} bytes")
    try:
        return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
    except (ValueError, OverflowError) as exc:  # e.g. a zero-size shape whose other sides overflow
        raise MalformedFrameError(f"tensor {name[:100]!r}: shape {str(shape)[:100]} is not valid: {exc}") from None
