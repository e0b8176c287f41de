"""Half-precision values on the wire: bfloat16 as uint16 bits, float16 as numpy's float16.

numpy has no bfloat16 and the PS never imports torch, so a bfloat16 array travels as the upper
16 bits of each float32 (uint16), converted by base/half.py (rounded to nearest even; the C kernels
of base/kernels.py where they are built). numpy functions, thread-safe.

A variable's **wire dtype** names how its gradients and values travel ("float32", "bfloat16",
"float16"); the PS keeps float32 masters whatever it is.
"""

from __future__ import annotations

import numpy as np

from paramserver.base.half import (
    BF16_NAN,
    bf16_bits_to_float32,
    float16_to_float32,
    float32_to_bf16_bits,
    float32_to_float16,
)

__all__ = [
    "BF16_NAN",
    "WIRE_DTYPES",
    "bf16_bits_to_float32",
    "float16_to_float32",
    "float32_to_bf16_bits",
    "float32_to_float16",
    "from_wire",
    "to_wire",
]

# how each wire dtype's arrays travel in a frame
WIRE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(np.uint16),
    "float16": np.dtype(np.float16),
}


def to_wire(values: np.ndarray, wire: str, out: np.ndarray | None = None) -> np.ndarray:
    """float32 `values` as `wire` dtype travels (values itself for float32)."""
    if wire == "float32":
        return values
    if wire == "bfloat16":
        return float32_to_bf16_bits(values, out)
    return float32_to_float16(values, out)


def from_wire(array: np.ndarray, wire: str) -> np.ndarray:
    """An array that travelled as `wire` dtype, as float32 (exact; array itself for float32)."""
    if wire == "bfloat16":
        return bf16_bits_to_float32(array)
    if wire == "float16":
        return float16_to_float32(array)
    return np.asarray(array, np.float32)
