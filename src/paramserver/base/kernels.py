"""The optional C kernels of `_kernels.c`, loaded through ctypes.

They run the PS's hot loops, the worker's id dedup and the Criteo parser.

`KERNELS` is the loaded library, or None when the extension was not built (or cannot load
here); every caller then uses its numpy path, which gives the same results. Callers read
`kernels.KERNELS` at call time, so tests can switch the numpy path on.

A kernel runs without the GIL (ctypes lets go of it for the call) and keeps no state of its own, so
threads may call kernels at once, on different arrays; the caller keeps an array still while a
kernel writes it (tables: their locks). The Python work around a call holds the GIL: `ptr` asks
the extension's `address` (a tenth of a microsecond) rather than numpy's `ctypes.data` (forty
times that), as a table call passes a dozen addresses.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import threading

import numpy as np

log = logging.getLogger(__name__)


def _load() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("paramserver.base._kernels")
    if spec is None or not spec.origin:
        log.info("C kernels not built; using numpy")
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError as exc:  # e.g. built for another platform: numpy still works
        log.warning("C kernels at %s unusable (%s); using numpy", spec.origin, exc)
        return None
    f, i64, i, d, p = ctypes.c_float, ctypes.c_int64, ctypes.c_int, ctypes.c_double, ctypes.c_void_p
    lib.ps_adam.argtypes = [p, p, p, p, p, i64, f, f, f, f, f, f, d, f, i, i, i]
    lib.ps_adagrad.argtypes = [p, p, p, i64, f, f, d, i]
    lib.ps_index_find.argtypes = [p, i64, p, i64, p]
    lib.ps_index_find.restype = i64
    lib.ps_stamp_rows.argtypes = [p, p, i64, ctypes.c_uint32]
    lib.ps_index_place.argtypes = [p, i64, p, p, i64]
    lib.ps_index_move.argtypes = [p, i64, i64, p, i64]
    lib.ps_index_remove.argtypes = [p, i64, p, i64]
    lib.ps_index_remove.restype = i64
    lib.ps_index_find_growing.argtypes = [p, i64, i64, i64, p, i64, p, i64, p]
    lib.ps_index_place_growing.argtypes = [p, i64, i64, i64, p, i64, p, p, i64]
    lib.ps_gather_rows.argtypes = [p, p, i64, i64, p]
    lib.ps_unique.argtypes = [p, i64, p, i64, p, p]
    lib.ps_unique.restype = i64
    lib.ps_scatter_add_rows.argtypes = [p, p, i64, i64, p]
    lib.ps_random_rows.argtypes = [p, i64, i64, i, f, p]
    lib.ps_sparse_adam.argtypes = [p, p, p, p, p, i64, i64, f, f, f, f]
    lib.ps_sparse_adagrad.argtypes = [p, p, p, p, i64, i64, f, f]
    for name in ("ps_bf16_from_f32", "ps_f32_from_bf16", "ps_f16_from_f32", "ps_f32_from_f16"):
        getattr(lib, name).argtypes = [p, i64, p]
    lib.ps_sgd.argtypes = [p, p, i64, f]
    lib.ps_max_abs_bits.argtypes = [p, i64]
    lib.ps_max_abs_bits.restype = ctypes.c_uint32
    lib.ps_copy_max_abs_bits.argtypes = [p, p, i64]
    lib.ps_copy_max_abs_bits.restype = ctypes.c_uint32
    lib.ps_all_finite.argtypes = [p, i64]
    lib.ps_all_finite.restype = i
    lib.ps_all_within.argtypes = [p, i64, ctypes.c_uint32]
    lib.ps_all_within.restype = i
    lib.ps_parse_criteo.argtypes = [ctypes.c_char_p, i64, i64, p, p, p]
    lib.ps_parse_criteo.restype = i64
    return lib


KERNELS = _load()
try:
    from paramserver.base._kernels import address as _address
except ImportError:  # not built, or built before it had `address`
    _address = None


_INFINITY_BITS = 0x7F800000
_measured = threading.local()  # this thread's received frame: its float32 tensors' largest magnitudes


def note_measured(buffer: object, spans: dict[int, tuple[int, int]]) -> None:
    """Tell the checks below that the float32 data at each address of `spans` ({address: (bytes, largest
    |value| as bits)}) was measured as it was received into `buffer`, in this thread. The owner of
    `buffer` empties `spans` (in place) before it writes the buffer again; `buffer` is kept here so
    that its memory cannot be another object's while an entry names it."""
    _measured.buffer, _measured.spans = buffer, spans


def _measured_bits(array: np.ndarray) -> int | None:
    spans = getattr(_measured, "spans", None)
    if not spans:
        return None
    entry = spans.get(array.ctypes.data)
    return entry[1] if entry is not None and entry[0] == array.nbytes else None


def max_abs_bits(address: int, nbytes: int) -> int:
    """The largest |value| of the float32 data at `address` (`nbytes`, a multiple of 4) as float32 bits
    (NaN above infinity above every finite value)."""
    assert KERNELS is not None
    return int(KERNELS.ps_max_abs_bits(address, nbytes // 4))


def copy_max_abs_bits(source: int, target: int, nbytes: int) -> int:
    """Copy `nbytes` (a multiple of 4) from address `source` to `target`, and return the largest
    |value| of them as float32 bits: a check of the data made by the copy that must be made anyway."""
    assert KERNELS is not None
    return int(KERNELS.ps_copy_max_abs_bits(source, target, nbytes // 4))


def all_finite(array: np.ndarray) -> bool:
    """Whether no value of `array` is NaN or infinite; for float32, one pass that allocates nothing,
    or none where the array was measured as it was received (note_measured)."""
    if KERNELS is not None and array.dtype == np.float32 and array.flags.c_contiguous:
        measured = _measured_bits(array)
        if measured is not None:
            return measured < _INFINITY_BITS
        return bool(KERNELS.ps_all_finite(array.ctypes.data, array.size))
    return bool(np.isfinite(array).all())


def all_within(array: np.ndarray, bound: float) -> bool:
    """Whether every value of `array` is finite and at most `bound` in magnitude; for float32, one
    pass that allocates nothing."""
    if KERNELS is not None and array.dtype == np.float32 and array.flags.c_contiguous:
        limit = _bound_bits(bound)
        measured = _measured_bits(array)
        if measured is not None:
            return measured <= int(limit)
        return bool(KERNELS.ps_all_within(array.ctypes.data, array.size, int(limit)))
    with np.errstate(invalid="ignore"):
        return bool(np.isfinite(array).all() and (np.abs(array) <= bound).all())


@functools.lru_cache(maxsize=64)
def _bound_bits(bound: float) -> int:
    """The float32 bits of `bound` (capped at the largest finite float32), as `all_within` compares them."""
    return int(np.float32(min(bound, float(np.finfo(np.float32).max))).view(np.uint32))


def ptr(array: np.ndarray | None) -> int | None:
    """The address of a C-contiguous array's data, for a kernel argument."""
    if array is None:
        return None
    if _address is not None:
        try:
            return _address(array)
        except (BufferError, ValueError, TypeError):  # a dtype numpy exports no buffer for
            pass
    return array.ctypes.data
