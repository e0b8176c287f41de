"""Shared-memory segments of the tensor stream: sealed memfds, so that no peer can shrink one.

A segment is an anonymous memory file (``memfd_create``) made by the worker, of two halves:
[0, capacity) requests, [capacity, 2 * capacity) replies. Before the worker offers it, it seals
the file's size (F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_SEAL): a mapping of a file that shrinks
under it would kill the PS with SIGBUS on its next read, and a sealed size never changes. The
PS opens the worker's descriptor through ``/proc/<pid>/fd/<n>`` (the kernel allows it to the
same user only) and refuses a file without those seals, one smaller than it claims, and any
named file: a peer can never point the PS at another file.

The PS copies each request out of the segment before it checks it: the worker can still write
the segment, and a value checked in memory the peer writes is not the value used.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
from typing import TypeGuard

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_MAX_CAPACITY = 1 << 40  # far above any message limit; keeps the size arithmetic sane


class SegmentError(ValueError):
    """A segment offered by a peer that the PS refuses to attach."""


class Segment:
    """One mapped segment; `requests` and `replies` are views of its halves."""

    _fd: int | None  # the memfd of a segment this process created, open until `close`

    def __init__(self, fd: int, capacity: int) -> None:
        self.capacity = capacity
        self._map = mmap.mmap(fd, 2 * capacity)
        self.view = memoryview(self._map)
        self.requests = self.view[:capacity]
        self.replies = self.view[capacity:]

    @classmethod
    def create(cls, capacity: int) -> tuple[Segment, dict]:
        """A new sealed segment and the spec a PS attaches it by ({"pid", "fd", "capacity"}). The
        descriptor stays open until `close` so that the PS can open it."""
        fd = os.memfd_create("paramserver-segment", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 2 * capacity)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            segment = cls(fd, capacity)
        except BaseException:
            os.close(fd)
            raise
        segment._fd = fd
        return segment, {"pid": os.getpid(), "fd": fd, "capacity": capacity}

    @classmethod
    def attach(cls, spec: dict) -> Segment:
        """The segment a peer offers; raises SegmentError naming what is wrong."""
        pid, fd_number, capacity = spec.get("pid"), spec.get("fd"), spec.get("capacity")
        if not (_is_count(pid) and _is_count(fd_number) and _is_count(capacity)) or not 0 < capacity <= _MAX_CAPACITY:
            raise SegmentError(f"attach needs integers pid, fd and capacity (0 < capacity <= {_MAX_CAPACITY})")
        try:
            fd = os.open(f"/proc/{pid}/fd/{fd_number}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise SegmentError(f"cannot open the peer's segment: {exc.strerror}") from None
        try:
            _check(fd, capacity)
            return cls(fd, capacity)
        finally:
            os.close(fd)  # the mapping keeps the memory

    def write(self, parts: list) -> int | None:
        """Copy a reply's parts into the reply half; None if they do not fit."""
        views = [memoryview(part).cast("B") for part in parts]
        size = sum(len(view) for view in views)
        if size > self.capacity:
            return None
        write_parts(self.replies, views)
        return size

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)
        try:
            for view in (self.requests, self.replies, self.view):
                view.release()
            self._map.close()
        except BufferError:  # arrays still view the segment; the mapping goes when they do
            pass


def write_parts(target: memoryview, parts: list) -> None:
    offset = 0
    for part in parts:
        part = memoryview(part).cast("B")
        target[offset : offset + len(part)] = part
        offset += len(part)


def _is_count(value: object) -> TypeGuard[int]:
    """An exact int (no bool, no float) that is not negative."""
    return type(value) is int and value >= 0


def _check(fd: int, capacity: int) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise SegmentError("the peer's segment is not a memory file")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & SEALS != SEALS:
        raise SegmentError("the peer's segment is not a sealed memory file (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)")
    if info.st_size < 2 * capacity:
        raise SegmentError(f"the peer's segment holds {info.st_size} bytes, not 2 x {capacity}")
