"""A PS's own subdirectory of the spill directory, where its tiered tables keep their cold rows.

Each PS takes ``<spill_dir>/shard-<index>-<8 hex>`` and holds an exclusive lock (flock) on its
``LOCK`` file while it runs; it deletes the subdirectory when it stops. What a PS that died left
(its lock is free once the process is gone, however it ended) is stale: the spill is a cache of the
training state, rebuilt from the checkpoint on restart, never trusted. So a PS starting with index
i deletes every ``shard-i-*`` subdirectory whose lock it can take, and leaves those whose lock is
held (another live PS with the same index sharing the directory, e.g. another job), and anything else.
A subdirectory is made under a dot name and renamed once locked, so that a starting PS never
sees another's half-made one as stale. The spill directory must be on a local filesystem (flock).
Thread-safety: made and closed by one thread (the PS's start and stop).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from ..base.errors import FailedPreconditionError

log = logging.getLogger(__name__)
LOCK = "LOCK"


class SpillSpace:
    """The subdirectory of one PS, locked while it exists."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._lock_fd = lock_fd
        self._tables = 0

    @classmethod
    def create(cls, spill_dir: str, shard_index: int) -> SpillSpace:
        """Delete this shard's stale subdirectories, then make and lock a new one."""
        root = Path(spill_dir)
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale(root, shard_index)
            making = Path(tempfile.mkdtemp(prefix=f".shard-{shard_index}-", dir=root))
            fd = os.open(making / LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path = root / f"shard-{shard_index}-{secrets.token_hex(4)}"
            making.rename(path)
        except OSError as exc:
            raise FailedPreconditionError(f"spill directory {spill_dir}: {exc}") from exc
        log.info("shard %d spills table rows to %s", shard_index, path)
        return cls(path, fd)

    def table_dir(self) -> str:
        """A new directory for one table's store."""
        self._tables += 1
        path = self.path / f"table-{self._tables}"
        path.mkdir()
        return str(path)

    def close(self) -> None:
        """Delete the subdirectory (its stores are closed) and release the lock."""
        if self._lock_fd < 0:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._lock_fd)
        self._lock_fd = -1


def remove_stale(root: Path, shard_index: int) -> list[Path]:
    """Delete the subdirectories of `root` that a dead PS of this shard left; returns them."""
    removed = []
    for pattern in (f"shard-{shard_index}-*", f".shard-{shard_index}-*"):
        for path in sorted(root.glob(pattern)):
            if path.is_dir() and not _in_use(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    if removed:
        log.info("removed stale spill directories a dead PS left: %s", ", ".join(map(str, removed)))
    return removed


def _in_use(path: Path) -> bool:
    """Whether a live process holds the lock of subdirectory `path` (or is making it: a dot name
    without a lock file yet)."""
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return path.name.startswith(".")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock if it was taken here
    return False
