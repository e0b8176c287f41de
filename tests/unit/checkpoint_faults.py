"""Filesystems that fail the way real ones do, over real files in a test's directory: a disk with
a few bytes left (a write puts what fits on disk, then fails with ENOSPC), one operation that
fails with a given errno, and a read-only directory (chmod where it stops writes; as root, where
it does not, a filesystem that answers EROFS to every write)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem


class Disk(LocalFileSystem):
    """The local filesystem with `space` bytes left for writes (None: no limit), and `fail`:
    {operation: errno} for operations that fail ("makedirs", "ls", "rm", "read", "write").
    `partial` records (path, bytes on disk) of every write that ran out of space."""

    cachable = False  # fsspec would hand every Disk() the same instance

    def __init__(self, space: int | None = None, fail: dict[str, int] | None = None) -> None:
        super().__init__()
        self.space = space
        self.fail = dict(fail or {})
        self.partial: list[tuple[str, int]] = []

    def _refuse(self, operation: str, path: str) -> None:
        if operation in self.fail:
            code = self.fail[operation]
            raise OSError(code, os.strerror(code), path)

    def makedirs(self, path, exist_ok=False):
        if not os.path.isdir(path):  # as on a read-only filesystem: an existing directory is no error
            self._refuse("makedirs", path)
        return super().makedirs(path, exist_ok=exist_ok)

    def ls(self, path, detail=False, **kwargs):
        self._refuse("ls", path)
        return super().ls(path, detail=detail, **kwargs)

    def rm(self, path, recursive=False, maxdepth=None):
        self._refuse("rm", path)
        return super().rm(path, recursive=recursive, maxdepth=maxdepth)

    def open(self, path, mode="rb", **kwargs):
        writing = any(flag in mode for flag in "wax+")
        self._refuse("write" if writing else "read", path)
        handle = super().open(path, mode, **kwargs)
        return _Budget(handle, path, self) if writing and self.space is not None else handle


class _Budget:
    """A file open for writing on a Disk: what fits is written to the real file, then ENOSPC."""

    def __init__(self, handle, path: str, disk: Disk) -> None:
        self.handle, self.path, self.disk = handle, path, disk

    def write(self, data) -> int:
        at, size = self.handle.tell(), os.fstat(self.handle.fileno()).st_size
        overwritten = max(0, min(len(data), size - at))  # bytes written over the file's own: no new space
        room = min(len(data), overwritten + self.disk.space)
        self.handle.write(bytes(data[:room]))
        self.handle.flush()
        self.disk.space -= room - overwritten
        if room < len(data):
            self.disk.partial.append((self.path, os.path.getsize(self.path)))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return room

    def flush(self) -> None:
        self.handle.flush()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.handle.seek(offset, whence)

    def fileno(self) -> int:
        return self.handle.fileno()

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> _Budget:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[Disk | None]:
    """Make `directory` and everything under it read-only for the block; yields the filesystem a
    store must use there: None (the real one) where chmod stops writes, else (as root) a Disk
    that fails every write with EROFS, as a read-only mount does. Permissions come back after."""
    paths = [directory, *directory.rglob("*")]
    modes = {path: path.stat().st_mode for path in paths}
    for path in paths:
        path.chmod(modes[path] & ~0o222)
    probe = directory / ".probe"
    try:
        probe.touch()
    except PermissionError:
        fs = None
    else:
        probe.unlink()
        fs = Disk(fail={"makedirs": errno.EROFS, "write": errno.EROFS, "rm": errno.EROFS})
    try:
        yield fs
    finally:
        for path in paths:
            path.chmod(modes[path])


def files(directory: Path) -> list[str]:
    """Every file under `directory`, relative to it, sorted (directories left out)."""
    return sorted(str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file())
