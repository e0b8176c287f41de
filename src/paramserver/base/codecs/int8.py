"""`int8`: the gradient quantized to int8 with one float32 scale per chunk of values, with error feedback.

Each chunk of `chunk` values of the flattened gradient (the last may be shorter) gets the scale
max|value| / 127, and each value q = round(value / scale), clipped to [-127, 127]; decoded,
value = q * scale. A dense gradient's chunk is CHUNK values; a table's row gradients pass their
width, one scale per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from paramserver.base.codecs._codec import Codec, Encoded
from paramserver.base.errors import InvalidArgumentError

CHUNK = 1024  # values per scale of a dense gradient
_INT8_MAX = 127.0


@dataclass(frozen=True)
class Int8(Codec):
    """Header {"codec": "int8", "chunk": C}; main tensor int8, the gradient's shape; auxiliary tensor
    `scale`: float32, one per C values of the flattened gradient."""

    kind: ClassVar[str] = "int8"
    payload_dtype: ClassVar[np.dtype] = np.dtype(np.int8)
    aux: ClassVar[tuple[str, ...]] = ("scale",)
    error_feedback: ClassVar[bool] = True

    def encode(self, grad: np.ndarray, chunk: int | None = None) -> Encoded:
        chunk = CHUNK if chunk is None else chunk
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
        return Encoded({"codec": self.kind, "chunk": chunk}, payload, {"scale": scales})

    @classmethod
    def decode(cls, name: str, header: dict, payload: np.ndarray, aux: dict[str, np.ndarray]) -> np.ndarray:
        chunk, scales = header.get("chunk"), aux["scale"]
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


def _by_chunk(flat: np.ndarray, per_chunk: np.ndarray, chunk: int) -> np.ndarray:
    """float32 `flat` times the value of each one's chunk (the last chunk may be short)."""
    out = np.empty(flat.size, np.float32)
    full = flat.size // chunk * chunk
    np.multiply(flat[:full].reshape(-1, chunk), per_chunk[: full // chunk, None], out=out[:full].reshape(-1, chunk))
    if full < flat.size:
        np.multiply(flat[full:], per_chunk[-1], out=out[full:])
    return out
