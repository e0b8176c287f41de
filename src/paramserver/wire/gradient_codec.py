"""Compressed gradients on the wire: how each codec encodes a float32 gradient, and how it is decoded.

The worker encodes (client/compression.py), the PS decodes (server/shard_service.py) before any
check or state change; both use this module, so the format lives in one place. Numpy only.

A compressed gradient travels as its main tensor under the gradient's own name, plus auxiliary
tensors named `aux_name(name, key)`, and a header in the request's `codecs` (by gradient name):

    {"codec": "fp16"}                  float16, the gradient's shape (a cast; above 65504 is inf)
    {"codec": "bf16"}                  uint16: the upper 16 bits of float32, rounded to nearest even
    {"codec": "int8", "chunk": C}      int8, the gradient's shape; `~NAME.scale`: float32, one scale per
                                       C values of the flattened gradient (value = q * scale)
    {"codec": "topk", "shape": [..]}   float32 values; `~NAME.index`: their strictly increasing positions
                                       (int32 or int64) in the flattened gradient; the rest are zero

A bad encoding (unknown codec, wrong dtype, wrong scale count, index out of range) raises
InvalidArgumentError naming the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paramserver.base.compression_spec import Codec
from paramserver.base.errors import InvalidArgumentError
from paramserver.wire.half import bf16_bits_to_float32, float32_to_bf16_bits

CHUNK = 1024  # values per int8 scale of a dense gradient (a table's rows: one scale per row)
_INT8_MAX = 127.0
_PAYLOAD_DTYPES = {"fp16": np.float16, "bf16": np.uint16, "int8": np.int8, "topk": np.float32}
_AUX = {"fp16": (), "bf16": (), "int8": ("scale",), "topk": ("index",)}


def aux_name(name: str, key: str) -> str:
    """The name of gradient `name`'s auxiliary tensor `key` (a leading "~": never a variable's name)."""
    return f"~{name}.{key}"


@dataclass(frozen=True)
class Encoded:
    """One encoded gradient: the request's header for it, its main tensor and its auxiliary ones."""

    header: dict[str, Any]
    payload: np.ndarray
    aux: dict[str, np.ndarray] = field(default_factory=dict)

    def tensors(self, name: str) -> list[tuple[str, np.ndarray]]:
        return [(name, self.payload), *((aux_name(name, key), array) for key, array in self.aux.items())]

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes + sum(array.nbytes for array in self.aux.values())


# ---- encode ------------------------------------------------------------------------------------
def encode(codec: Codec, grad: np.ndarray, chunk: int = CHUNK) -> Encoded:
    """`grad` (float32) encoded by `codec` (not `none`); `chunk`: values per int8 scale."""
    if codec.kind == "fp16":
        return Encoded({"codec": "fp16"}, grad.astype(np.float16))
    if codec.kind == "bf16":
        return Encoded({"codec": "bf16"}, float32_to_bf16_bits(np.ascontiguousarray(grad, dtype=np.float32)))
    if codec.kind == "int8":
        return _encode_int8(grad, chunk)
    if codec.kind == "topk":
        return _encode_topk(grad, codec.ratio)
    raise InvalidArgumentError(f"codec {codec} does not encode gradients")


def _encode_int8(grad: np.ndarray, chunk: int) -> Encoded:
    flat = grad.reshape(-1)
    starts = np.arange(0, flat.size, chunk)
    scales = (
        (np.maximum.reduceat(np.abs(flat), starts) / _INT8_MAX).astype(np.float32)
        if flat.size
        else np.zeros(0, np.float32)
    )
    inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
    quantized = np.rint(_by_chunk(flat, inverse, chunk), out=...)
    payload = np.clip(quantized, -_INT8_MAX, _INT8_MAX, out=quantized).astype(np.int8).reshape(grad.shape)
    return Encoded({"codec": "int8", "chunk": chunk}, payload, {"scale": scales})


def _encode_topk(grad: np.ndarray, ratio: float) -> Encoded:
    flat = grad.reshape(-1)
    keep = min(flat.size, max(1, math.ceil(ratio * flat.size)))
    index = (
        np.sort(np.argpartition(np.abs(flat), flat.size - keep)[flat.size - keep :])
        if keep < flat.size
        else np.arange(flat.size)
    )
    index = index.astype(np.int32 if flat.size <= np.iinfo(np.int32).max else np.int64)
    return Encoded({"codec": "topk", "shape": list(grad.shape)}, flat[index].astype(np.float32), {"index": index})


def _by_chunk(flat: np.ndarray, per_chunk: np.ndarray, chunk: int) -> np.ndarray:
    """float32 `flat` times the value of each one's chunk (the last chunk may be short)."""
    out = np.empty(flat.size, np.float32)
    full = flat.size // chunk * chunk
    np.multiply(flat[:full].reshape(-1, chunk), per_chunk[: full // chunk, None], out=out[:full].reshape(-1, chunk))
    if full < flat.size:
        np.multiply(flat[full:], per_chunk[-1], out=out[full:])
    return out


# ---- decode ------------------------------------------------------------------------------------
def decode(name: str, header: Any, payload: np.ndarray, aux: dict[str, np.ndarray]) -> np.ndarray:
    """Gradient `name` as float32, from its header, main tensor and auxiliary tensors."""
    kind = header.get("codec") if isinstance(header, dict) else None
    if kind not in _PAYLOAD_DTYPES:
        raise InvalidArgumentError(
            f"gradient {name!r}: unknown encoding {str(header)[:100]} (codec one of {', '.join(_PAYLOAD_DTYPES)})"
        )
    if payload.dtype != _PAYLOAD_DTYPES[kind]:
        raise InvalidArgumentError(
            f"gradient {name!r}: {kind} carries {np.dtype(_PAYLOAD_DTYPES[kind]).name}, got {payload.dtype}"
        )
    if kind == "fp16":
        return payload.astype(np.float32)
    if kind == "bf16":
        return bf16_bits_to_float32(payload)
    if kind == "int8":
        return _decode_int8(name, header, payload, aux["scale"])
    return _decode_topk(name, header, payload, aux["index"])


def _decode_int8(name: str, header: dict, payload: np.ndarray, scales: np.ndarray) -> np.ndarray:
    chunk = header.get("chunk")
    if type(chunk) is not int or chunk < 1:
        raise InvalidArgumentError(f"gradient {name!r}: int8 chunk must be a positive integer, got {chunk!r}")
    expected = -(-payload.size // chunk)
    if scales.dtype != np.float32 or scales.shape != (expected,):
        raise InvalidArgumentError(
            f"gradient {name!r}: int8 needs {expected} float32 scales (one per {chunk} "
            f"values), got {scales.dtype} {tuple(scales.shape)}"
        )
    if not np.isfinite(scales).all():
        raise InvalidArgumentError(f"gradient {name!r}: int8 scales hold NaN or infinite values")
    return _by_chunk(payload.reshape(-1), scales, chunk).reshape(payload.shape)


def _decode_topk(name: str, header: dict, values: np.ndarray, index: np.ndarray) -> np.ndarray:
    shape = header.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape) or len(shape) > 32:
        raise InvalidArgumentError(f"gradient {name!r}: topk shape must be a list of sizes, got {str(shape)[:100]}")
    size = math.prod(shape)
    if index.dtype not in (np.int32, np.int64) or index.ndim != 1 or values.shape != index.shape:
        raise InvalidArgumentError(
            f"gradient {name!r}: topk needs 1-d int32/int64 positions, one per value; got "
            f"{index.dtype} {tuple(index.shape)} for values {tuple(values.shape)}"
        )
    if index.size and (index[0] < 0 or index[-1] >= size or not (index[1:] > index[:-1]).all()):
        raise InvalidArgumentError(f"gradient {name!r}: topk positions must be strictly increasing within [0, {size})")
    dense = np.zeros(size, np.float32)
    dense[index] = values
    return dense.reshape(shape)


def decode_tensors(tensors: dict[str, np.ndarray], codecs: dict[str, Any]) -> dict[str, np.ndarray]:
    """A request's tensors with every gradient named in `codecs` decoded to float32 and its auxiliary
    tensors removed (a new dict: nothing else changes). Raises InvalidArgumentError."""
    if not codecs:
        return tensors
    out = dict(tensors)
    for name, header in codecs.items():
        if name not in tensors:
            raise InvalidArgumentError(f"encoding given for gradient {name!r}, which the request does not carry")
        kind = header.get("codec") if isinstance(header, dict) else None
        aux = {}
        for key in _AUX.get(kind, ()) if isinstance(kind, str) else ():  # decode() refuses any other kind
            if aux_name(name, key) not in out:
                raise InvalidArgumentError(f"gradient {name!r}: {kind} needs tensor {aux_name(name, key)!r}")
            aux[key] = out.pop(aux_name(name, key))
        out[name] = decode(name, header, tensors[name], aux)
    return out
