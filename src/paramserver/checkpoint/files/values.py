"""The checks on a checkpoint's values, one definition for the writer and the readers.

A shard file's writer applies them to each slice as it writes it (shard_file.py); a reader of a
file from disk to each piece as it reads it (chain.py). What they refuse: a NaN or an infinity in
a floating-point tensor (float32, float64, float16, or bfloat16 bits), unless allowed; an int8
encoding's scale out of its range (quantize.py), always.
"""

from __future__ import annotations

import numpy as np

from paramserver.base import kernels
from paramserver.checkpoint.files import quantize


def problem(tensor: str, array: np.ndarray, allow_non_finite: bool = False) -> str | None:
    """What is wrong with a piece of tensor `tensor`'s values `array` (its file dtype), or None."""
    if tensor.endswith("/" + quantize.SCALE) and not quantize.scales_in_range(array):
        return f"tensor {tensor!r} holds a scale that is negative, not finite or above {quantize.MAX_SCALE:.4g}"
    if allow_non_finite or finite(array):
        return None
    return f"tensor {tensor!r} holds NaN or infinite values"


def finite(array: np.ndarray) -> bool:
    """No NaN or infinity in `array` (bfloat16 bits, as quantize.BF16_BITS, count as floats); any
    other integer array is finite."""
    if array.dtype.kind == "f":
        return kernels.all_finite(array)
    return array.dtype != quantize.BF16_BITS or quantize.bf16_finite(array)
