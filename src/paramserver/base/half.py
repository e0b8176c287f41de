"""Half precision in numpy: float32 <-> bfloat16 as uint16 bits, and <-> float16, by the C kernels where built.

numpy has no bfloat16 and the PS never imports torch, so a bfloat16 array is held as the upper
16 bits of each float32 (uint16). float32 -> bfloat16 rounds to nearest, ties to even, as torch
does; a NaN stays a NaN (0x7FC0, c10's scalar conversion; torch's vectorized CPU path writes 0xFFFF
instead, also a NaN). bfloat16 -> float32 is exact. Thread-safe. How a variable's values travel in
these dtypes: wire/half.py; a gradient codec that sends bfloat16: base/codecs/bf16.py.
"""

from __future__ import annotations

import numpy as np

from paramserver.base import kernels

BF16_NAN = np.uint16(0x7FC0)


def float32_to_bf16_bits(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values as bfloat16 bits (uint16, same shape), rounded to nearest even."""
    values = np.ascontiguousarray(values, np.float32)
    out, done = by_kernel("ps_bf16_from_f32", values, out, np.uint16)
    if done:
        return out
    bits = values.view(np.uint32)
    rounded = bits >> 16
    rounded &= 1
    rounded += 0x7FFF  # with the lowest kept bit: ties go to even
    rounded += bits  # cannot wrap for a finite value or an infinity (at most 0xFF800000 + 0x8000)
    rounded >>= 16
    np.copyto(out, rounded, casting="unsafe")
    nan = np.isnan(values)
    if nan.any():  # a NaN's payload could round into an infinity
        out[nan] = BF16_NAN
    return out


def bf16_bits_to_float32(bits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bfloat16 bits (uint16) as float32 values (exact)."""
    bits = np.asarray(bits, np.uint16)
    out, done = by_kernel("ps_f32_from_bf16", bits, out, np.float32)
    if not done:
        wide = out.view(np.uint32)
        np.copyto(wide, bits, casting="safe")
        wide <<= 16
    return out


def float32_to_float16(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values as float16 (same shape), rounded to nearest even; beyond float16's range is
    infinity, as in torch. The C kernel where built: numpy's cast of values that become float16
    subnormals (gradients of 1e-5 and less) is software, 14x slower."""
    values = np.ascontiguousarray(values, np.float32)
    out, done = by_kernel("ps_f16_from_f32", values, out, np.float16)
    if not done:
        with np.errstate(over="ignore"):
            np.copyto(out, values, casting="unsafe")
    return out


def float16_to_float32(values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float16 values as float32 (exact); the C kernel where built (numpy's cast of subnormals is slow)."""
    values = np.asarray(values, np.float16)
    out, done = by_kernel("ps_f32_from_f16", values, out, np.float32)
    if not done:
        np.copyto(out, values)
    return out


def by_kernel(name: str, source: np.ndarray, out: np.ndarray | None, dtype) -> tuple[np.ndarray, bool]:
    """`out` (a new array of `dtype` when None) and whether C kernel `name` converted `source` into it:
    False when the kernels are not built or an array is not contiguous (numpy's turn then)."""
    if out is None:
        out = np.empty(source.shape, dtype)
    if out.shape != source.shape:
        raise ValueError(f"output of shape {out.shape} for values of shape {source.shape}")
    if kernels.KERNELS is None or not (source.flags.c_contiguous and out.flags.c_contiguous):
        return out, False
    getattr(kernels.KERNELS, name)(kernels.ptr(source), source.size, kernels.ptr(out))
    return out, True
