"""Embedding rows stored smaller in checkpoint files: bfloat16, or int8 with one float32 scale per row.

A table's ``values`` (the rows themselves, not their optimizer state) may be written in an
*encoding* other than float32 (option ``checkpoint_quantize``, docs/checkpoints.md):

- ``bf16``: ``table/<t>/values`` holds bfloat16 (safetensors dtype BF16, read and written here as
  its uint16 bits), rounded to nearest even; a finite value that would round to an infinity is
  kept at the largest finite bfloat16. 2 bytes a value.
- ``int8``: ``table/<t>/values`` holds int8 and ``table/<t>/values.scale`` one float32 per row:
  a row is ``q * scale`` with ``scale = max |value| / 127`` (0 for a row of zeros) and ``q`` the
  values divided by it, rounded to the nearest integer. 1 byte a value and 4 a row.

The encoding is named in the table's metadata (``"encoding"``; absent means float32) and checked
against the tensors before anything is read (shard_meta.py). Decoding is exact and deterministic,
so a row written twice with the same values reads back with the same bits (a chain still equals a
whole checkpoint). Every check of an encoding is here: the tensors a table's encoding needs, of
their dtypes and shapes (`layout_problem`, when a file's header is read), and each int8 scale
finite, not negative and small enough that no decoded value overflows, whatever its code: q runs
from -128 to 127, so 128 times the scale must be finite (`scales_in_range`, on the pass that
hashes the file).
"""

from __future__ import annotations

import numpy as np

from paramserver.checkpoint.store import CheckpointError
from paramserver.wire.half import bf16_bits_to_float32, float32_to_bf16_bits

NONE = "none"
ENCODINGS = ("none", "bf16", "int8")  # the option's values; "none" writes float32 as before
SCALE = "values.scale"  # the int8 encoding's per-row scales, beside "values"
_INT8_MAX = 127  # the codes this writer uses: -127..127
_INT8_LARGEST = 128  # the largest |q| a file may hold (q = -128)
# the largest scale whose 128 times is finite in float32 (exact: 128 is a power of two); a larger
# one could decode q = -128 to an infinity
MAX_SCALE = np.float32(np.finfo(np.float32).max / _INT8_LARGEST)
BF16_BITS = np.dtype(np.uint16)  # how bfloat16 values are held (numpy has no bfloat16)
_STORED: dict[str, np.dtype] = {"bf16": BF16_BITS, "int8": np.dtype(np.int8)}


def stored_dtype(encoding: str) -> np.dtype:
    """The dtype of ``values`` in a file written with `encoding` (bf16: its uint16 bits)."""
    return _STORED.get(encoding, np.dtype(np.float32))


def layout(encoding: str, dim_shape: tuple[int, ...]) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The tensors that hold a table's values in `encoding`: name -> (dtype, shape of one row)."""
    found = {"values": (stored_dtype(encoding), tuple(dim_shape))}
    if encoding == "int8":
        found[SCALE] = (np.dtype(np.float32), ())
    return found


def layout_problem(
    encoding: str, dim: int, tensors: dict[str, tuple[np.dtype, tuple[int, ...]]], rows: int
) -> str | None:
    """What is wrong with the value tensors of a table of `rows` rows of `dim` stored in `encoding`
    (`tensors`: its tensors by name, "values", "values.scale", as (dtype, shape)), or None."""
    if encoding not in _STORED and encoding != "float32":
        return f"is stored in an unknown encoding {str(encoding)[:40]!r}"
    for name, (dtype, row_shape) in layout(encoding, (dim,)).items():
        found = tensors.get(name)
        want = (rows, *row_shape)
        if found is None or np.dtype(found[0]) != dtype or tuple(found[1]) != want:
            shown = f"{np.dtype(found[0])} of shape {tuple(found[1])}" if found is not None else "missing"
            return f"is {encoding}-encoded, its {name} must be {dtype} of shape {want}, not {shown}"
    return None


def encode(values: np.ndarray, encoding: str) -> dict[str, np.ndarray]:
    """float32 rows (n x dim) as they are stored in `encoding`: {"values": ..., and "values.scale"}."""
    values = np.ascontiguousarray(values, np.float32)
    if encoding == "bf16":
        bits = float32_to_bf16_bits(values)
        overflowed = (bits & 0x7FFF) == 0x7F80  # an infinity from a finite value: the largest finite one
        if overflowed.any():
            bits[overflowed & np.isfinite(values)] -= 1
        return {"values": bits}
    if encoding == "int8":
        peak = np.abs(values).max(axis=1) if values.shape[0] and values.shape[1] else np.zeros(values.shape[0])
        scale = np.minimum((peak / np.float32(_INT8_MAX)).astype(np.float32), MAX_SCALE)
        safe = np.where(scale > 0, scale, np.float32(1))
        quantized = np.rint(values / safe[:, None])
        np.clip(quantized, -_INT8_MAX, _INT8_MAX, out=quantized)
        return {"values": quantized.astype(np.int8), SCALE: scale}
    return {"values": values}


def decode(encoding: str, stored: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """The float32 rows of `stored` values (and the int8 encoding's per-row `scale`)."""
    if encoding == "bf16":
        return bf16_bits_to_float32(stored)
    if encoding == "int8":
        if scale is None:
            raise CheckpointError("int8 values without their scales")
        return stored.astype(np.float32) * scale.astype(np.float32, copy=False)[:, None]
    return stored


def scales_in_range(scales: np.ndarray) -> bool:
    """No int8 scale negative, not finite, or large enough for a decoded value to overflow."""
    return not scales.size or bool(((scales >= 0) & (scales <= MAX_SCALE)).all())


def bf16_finite(bits: np.ndarray) -> bool:
    """No infinity or NaN among bfloat16 bits."""
    return not bool(((bits & 0x7F80) == 0x7F80).any())
