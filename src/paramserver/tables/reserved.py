"""Arrays in reserved address space: they grow without a copy, and hand memory back.

An embedding table's row arrays and its hash index's slots used to grow by allocating a larger
array and copying into it: at tens of millions of rows a copy of gigabytes, seconds during which
every lookup of the shard waits. Instead `reserve` maps anonymous private memory with
MAP_NORESERVE: the kernel gives a page memory only when it is first written, and an unwritten
page reads as zeros, so reserving far more rows than are used costs address space, not memory,
and growing is using more of it. `release` hands whole pages of rows no longer used back to the
kernel (they read as zeros again). `populate` faults pages in ahead of use, in order: an array
written at random places (a hash index) would otherwise stop on a page fault at nearly every
write while it is fresh, tens of thousands per batch.

The mapping may be refused: under strict overcommit (vm.overcommit_memory=2 ignores
MAP_NORESERVE) or an address-space limit (RLIMIT_AS, `ulimit -v`). `reserve` then returns None
and the caller keeps ordinary arrays grown by copying. A memory cgroup limit is no obstacle: it
counts written pages only.

Thread-safety: the functions keep no state of their own; an array is as thread-safe as numpy's.
"""

from __future__ import annotations

import contextlib
import mmap
import sys

import numpy as np

# Linux's MAP_NORESERVE (Python's mmap names it only from 3.13); elsewhere no flag is needed:
# macOS and the BSDs commit anonymous pages when they are written anyway.
_LINUX = sys.platform.startswith("linux")
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000) if _LINUX else 0
_PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and arm64 with 4 KiB pages
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14 (Python names it from 3.13)


def reserve(rows: int, row_shape: tuple[int, ...], dtype: np.dtype | type, huge: bool = False) -> np.ndarray | None:
    """A (rows, *row_shape) array of zeros in its own anonymous mapping, taking memory only where
    written; None where the system refuses the mapping (then use np.zeros and copy to grow).
    `huge`: ask for 2 MiB pages (transparent huge pages), for arrays read at random rows."""
    dtype = np.dtype(dtype)
    count = rows * int(np.prod(row_shape, dtype=np.int64))
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE
    try:
        mapping = mmap.mmap(-1, max(1, count * dtype.itemsize), flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, OverflowError, ValueError):  # ENOMEM: strict overcommit or RLIMIT_AS
        return None
    if huge and _LINUX and hasattr(mmap, "MADV_HUGEPAGE"):
        # 2 MiB pages where transparent huge pages are on (or "madvise"): rows are read and updated
        # at random, and 4 KiB pages miss the TLB at nearly every row of a table of gigabytes
        # (measured: lookup+update of 20M rows, uniform ids, 2.84M -> 3.47M rows/s)
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapping, dtype, count=count).reshape((rows, *row_shape))


def is_reserved(array: np.ndarray) -> bool:
    """Whether `array` (or what it is a view of) came from `reserve`."""
    return _mapping(array) is not None


def release(array: np.ndarray, lo: int, hi: int) -> None:
    """Zero rows [lo, hi) of a C-contiguous `array`; where it came from `reserve`, its whole pages
    there are handed back to the kernel instead of written (they cost no memory until written)."""
    if hi <= lo:
        return
    mapping = _mapping(array)
    if mapping is None or not _LINUX or not array.flags.c_contiguous:  # Linux's DONTNEED zeroes; not all do
        array[lo:hi] = 0
        return
    start, end = _byte_range(mapping, array, lo, hi)
    whole = np.frombuffer(mapping, np.uint8)
    first, last = _whole_pages(whole.ctypes.data, start, end, _PAGE)
    if last <= first:
        whole[start:end] = 0
        return
    whole[start:first] = 0
    whole[last:end] = 0
    mapping.madvise(mmap.MADV_DONTNEED, first, last - first)  # private anonymous: zero pages after


def hand_back(array: np.ndarray, lo: int, hi: int, page: int = _PAGE) -> None:
    """Hand the whole `page`-sized pages inside rows [lo, hi) of an array from `reserve` back to
    the kernel (they read as zeros after); the rest of the rows is left as it is, so the caller
    zeroes rows itself. `page=HUGE_PAGE` for an array asked for huge pages: handing back part of a
    huge page splits it, which costs more than the page's zeroing (a growing hash index's old
    slots: docs/scaling.md). Does nothing for other arrays."""
    mapping = _mapping(array)
    if hi <= lo or mapping is None or not _LINUX or not array.flags.c_contiguous:
        return
    first, last = _whole_pages(np.frombuffer(mapping, np.uint8).ctypes.data, *_byte_range(mapping, array, lo, hi), page)
    if last > first:
        mapping.madvise(mmap.MADV_DONTNEED, first, last - first)


def _byte_range(mapping: mmap.mmap, array: np.ndarray, lo: int, hi: int) -> tuple[int, int]:
    """Offsets in `mapping` of rows [lo, hi) of `array`."""
    start = array.ctypes.data - np.frombuffer(mapping, np.uint8).ctypes.data + lo * array.strides[0]
    return start, start + (hi - lo) * array.strides[0]


def _whole_pages(base: int, start: int, end: int, page: int) -> tuple[int, int]:
    """The widest [first, last) within offsets [start, end) of a mapping at address `base` that
    covers whole `page`s (aligned by address: a mapping need not start at a huge page)."""
    return -(-(base + start) // page) * page - base, (base + end) // page * page - base


def populate(array: np.ndarray, lo: int, hi: int) -> None:
    """Fault the pages of rows [lo, hi) of a C-contiguous `array` in now, in order (their contents
    stay as they are): one madvise where the kernel offers MADV_POPULATE_WRITE, else a write per page.
    Only a speed-up: a strided array is left alone."""
    if hi <= lo or not array.flags.c_contiguous:
        return
    mapping = _mapping(array)
    if mapping is not None and _LINUX:
        start, end = _byte_range(mapping, array, lo, hi)
        first = start // _PAGE * _PAGE
        try:
            mapping.madvise(_MADV_POPULATE_WRITE, first, end - first)
            return
        except OSError:  # an older kernel (EINVAL): touch the pages instead
            pass
    raw = array[lo:hi].reshape(-1).view(np.uint8)
    touched = raw[::_PAGE]
    np.bitwise_or(touched, 0, out=touched)


def _mapping(array: np.ndarray) -> mmap.mmap | None:
    base: object = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, mmap.mmap) else None
