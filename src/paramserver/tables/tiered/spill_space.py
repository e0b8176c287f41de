"""A PS's own subdirectory of the spill directory, where its tiered tables keep their cold rows.

Each PS takes ``<spill_dir>/shard-<index>-<8 hex>`` and holds an exclusive lock (flock) on its
``LOCK`` file while it runs; it deletes the subdirectory when it stops. What a PS that died left
(its lock is free once the process is gone, however it ended) is stale: the spill is a cache of the
training state, rebuilt from the checkpoint on restart, never trusted. So a PS starting with index
i deletes every ``shard-i-*`` subdirectory that is marked as a PS's own and whose lock it can take,
and leaves those whose lock is held (another live PS with the same index sharing the directory,
e.g. another job), and anything else.

What a PS deletes is only what a PS made: a real directory (never a symbolic link), owned by this
user, holding the marker file ``PARAMSERVER_SPILL`` that the PS wrote when it made it. Every step
goes through file descriptors opened with O_NOFOLLOW (and ``shutil.rmtree`` on a directory
descriptor, which follows no link), so a link planted in the spill directory leads nowhere. The
spill directory itself must be a real directory: a symbolic link is refused at start with an error
saying so. In a spill directory of another user (a Kubernetes emptyDir is root's; a shared scratch
disk), the PS works in a subdirectory of its own, ``paramserver-<uid>`` (made 0700), and refuses
one that is not its user's real directory: another user cannot plant or swap what it deletes.
A PS's subdirectory is made under a dot name, locked and marked, then renamed, so that a starting
PS never sees another's half-made one as stale. The spill directory must be on a local filesystem
(flock). Thread-safety: made and closed by one thread (the PS's
start and stop); `problem` may be called from any thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import stat
from pathlib import Path

from paramserver.base.errors import FailedPreconditionError

log = logging.getLogger(__name__)
LOCK = "LOCK"
MARKER = "PARAMSERVER_SPILL"
_MAGIC = b"paramserver spill space\n"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class SpillSpace:
    """The subdirectory of one PS, locked and marked while it exists."""

    def __init__(self, root: Path, name: str, root_fd: int, lock_fd: int, identity: tuple[int, int]) -> None:
        self.root, self.name = root, name
        self.path = root / name
        self._root_fd, self._lock_fd = root_fd, lock_fd
        self._identity = identity  # (st_dev, st_ino) of the subdirectory made
        self._tables = 0

    @classmethod
    def create(cls, spill_dir: str, shard_index: int) -> SpillSpace:
        """Delete this shard's stale subdirectories, then make, lock and mark a new one."""
        root_fd, root = open_spill_dir(spill_dir)
        try:
            _remove_stale(root_fd, root, shard_index)
            name, lock_fd, identity = _make_own(root_fd, shard_index)
        except OSError as exc:
            os.close(root_fd)
            raise FailedPreconditionError(f"spill directory {spill_dir}: {exc}") from exc
        except BaseException:
            os.close(root_fd)
            raise
        space = cls(root, name, root_fd, lock_fd, identity)
        log.info("shard %d spills table rows to %s", shard_index, space.path)
        return space

    def table_dir(self) -> str:
        """A new directory for one table's store."""
        self._tables += 1
        path = self.path / f"table-{self._tables}"
        path.mkdir(mode=0o700)
        return str(path)

    def problem(self) -> str | None:
        """What is wrong with the subdirectory now (removed, replaced, its marker gone), or None."""
        try:
            found = os.lstat(self.path)
            if (found.st_dev, found.st_ino) != self._identity or not stat.S_ISDIR(found.st_mode):
                return f"spill directory {self.path} was replaced by something this PS did not make"
            os.lstat(self.path / MARKER)
        except FileNotFoundError:
            return f"spill directory {self.path} (or its marker) was removed while the PS used it"
        except OSError as exc:
            return f"spill directory {self.path} cannot be checked: {exc}"
        return None

    def close(self) -> bool:
        """Delete the subdirectory (its stores are closed) and release the lock; returns whether it
        was deleted. One that is not the directory this PS made any more is left alone. Never raises."""
        if self._lock_fd < 0:
            return False
        deleted = False
        trouble = self.problem()
        if trouble is None:
            try:
                shutil.rmtree(self.name, dir_fd=self._root_fd)
                deleted = True
            except OSError as exc:
                log.warning("cannot delete the spill directory %s: %s", self.path, exc)
        else:
            log.warning("%s: not deleting anything there", trouble)
        self.abandon()
        return deleted

    def abandon(self) -> None:
        """Release the lock and the directory handle, leaving the subdirectory as it is: what a
        killed PS leaves behind for the next one to delete (a test seam: a PS that stops calls
        `close`). The space is not used again."""
        if self._lock_fd < 0:
            return
        os.close(self._lock_fd)
        os.close(self._root_fd)
        self._lock_fd = self._root_fd = -1


def open_spill_dir(spill_dir: str) -> tuple[int, Path]:
    """A descriptor of the directory the PS works in, and its path: the spill directory when it is
    this user's (made, mode 0700, when missing); in one of another user's (a Kubernetes emptyDir
    owned by root, a shared scratch disk), a subdirectory ``paramserver-<uid>`` of this user's own.
    Refused with FailedPreconditionError when the spill directory is a symbolic link or not a
    directory, or when that subdirectory is not this user's own real directory."""
    path = Path(spill_dir)
    try:
        if not os.path.lexists(path):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = _open_real_dir(path, f"spill directory {spill_dir}")
        if os.fstat(fd).st_uid == os.geteuid():
            return fd, path
        try:  # not this user's: a subdirectory of its own, which no one else can plant things in
            own = f"paramserver-{os.geteuid()}"
            with contextlib.suppress(FileExistsError):
                os.mkdir(own, 0o700, dir_fd=fd)
            owner = os.fstat(fd).st_uid
            sub = _open_real_dir(path / own, f"{path / own} (this user's part of {spill_dir}, which is uid {owner}'s)")
        finally:
            os.close(fd)
    except OSError as exc:
        raise FailedPreconditionError(f"spill directory {spill_dir}: {exc}") from exc
    if os.fstat(sub).st_uid != os.geteuid():
        os.close(sub)
        raise FailedPreconditionError(
            f"spill directory {spill_dir} belongs to uid {os.lstat(path).st_uid} and its subdirectory {own} "
            f"(where this PS would work) to uid {os.lstat(path / own).st_uid}, not to this user "
            f"(uid {os.geteuid()}): remove it, or give a spill directory of your own"
        )
    log.info("spill directory %s is not this user's: this PS works in %s", spill_dir, path / own)
    return sub, path / own


def _open_real_dir(path: Path, what: str) -> int:
    """A descriptor of directory `path`, refused when it is a symbolic link or not a directory."""
    found = os.lstat(path)
    if stat.S_ISLNK(found.st_mode):
        raise FailedPreconditionError(
            f"{what} is a symbolic link (to {os.readlink(path)}): a PS deletes what it finds "
            f"there, so it takes only a real directory; give the directory itself"
        )
    if not stat.S_ISDIR(found.st_mode):
        raise FailedPreconditionError(f"{what} is not a directory")
    fd = os.open(path, _DIR_FLAGS)
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (found.st_dev, found.st_ino):  # swapped since the lstat
        os.close(fd)
        raise FailedPreconditionError(f"{what} changed while it was opened")
    return fd


def remove_stale(root: Path, shard_index: int) -> list[Path]:
    """Delete the subdirectories of `root` that a dead PS of this shard left; returns them."""
    fd, where = open_spill_dir(str(root))
    try:
        return _remove_stale(fd, where, shard_index)
    finally:
        os.close(fd)


def _remove_stale(root_fd: int, root: Path, shard_index: int) -> list[Path]:
    removed = []
    names = sorted(os.listdir(root_fd))
    for name in names:
        if not (name.startswith(f"shard-{shard_index}-") or name.startswith(f".shard-{shard_index}-")):
            continue
        lock_fd = _take_if_stale(root_fd, name)
        if lock_fd is None:
            continue
        try:
            shutil.rmtree(name, dir_fd=root_fd)
            removed.append(root / name)
        except OSError as exc:
            log.warning("cannot delete the stale spill directory %s: %s", root / name, exc)
        finally:
            os.close(lock_fd)
    if removed:
        log.info("removed stale spill directories a dead PS left: %s", ", ".join(map(str, removed)))
    return removed


def _take_if_stale(root_fd: int, name: str) -> int | None:
    """The lock of subdirectory `name`, taken, when it is a PS's own (a directory of this user with
    the marker, reached with no link followed) and no live process holds it; else None."""
    try:
        found = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid():
            log.info("spill directory entry %s is not a directory of this user's: left alone", name)
            return None
        sub_fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return None
    try:
        if not _marked(sub_fd):
            log.info("spill directory entry %s holds no PS's marker: not made by a PS, left alone", name)
            return None
        lock_fd = os.open(LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sub_fd)
    except OSError:
        return None  # no lock file yet: a PS is still making it
    finally:
        os.close(sub_fd)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        return None  # a live PS holds it
    return lock_fd


def _marked(dir_fd: int) -> bool:
    """Whether the directory holds the marker a PS writes (a regular file of this user's)."""
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        found = os.fstat(fd)
        return stat.S_ISREG(found.st_mode) and found.st_uid == os.geteuid() and os.read(fd, 64).startswith(_MAGIC)
    finally:
        os.close(fd)


def _make_own(root_fd: int, shard_index: int) -> tuple[str, int, tuple[int, int]]:
    """Make, lock and mark a new subdirectory (under a dot name, then renamed); returns its name,
    the lock's descriptor and its identity (st_dev, st_ino)."""
    token = secrets.token_hex(4)
    making, name = f".shard-{shard_index}-{token}", f"shard-{shard_index}-{token}"
    os.mkdir(making, 0o700, dir_fd=root_fd)
    sub_fd = os.open(making, _DIR_FLAGS, dir_fd=root_fd)
    try:
        lock_fd = os.open(LOCK, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=sub_fd)
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        marker = os.open(
            MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=sub_fd
        )
        try:
            os.write(marker, _MAGIC + f"shard {shard_index}\npid {os.getpid()}\n".encode())
        finally:
            os.close(marker)
        made = os.fstat(sub_fd)
    finally:
        os.close(sub_fd)
    os.rename(making, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    return name, lock_fd, (made.st_dev, made.st_ino)
