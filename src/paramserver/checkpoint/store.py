"""Where checkpoints live: a directory (local path, NFS, or an fsspec URL such as s3://bucket/run).

Layout: ``<dir>/ckpt-<step:09d>/shard-<i>.safetensors`` (one file per shard) and
``<dir>/ckpt-<step>/MANIFEST.json``, written last. The manifest's presence is the commit: a
checkpoint without one is incomplete and ignored. The manifest names every shard file with its
size and SHA-256, so a truncated, missing or tampered file is found before it is used.

Local writes go to a temporary name (``<file>.tmp-<8 hex>``), are fsynced, then renamed (and the
directory fsynced); a write that fails removes its temporary file, and one a crashed writer left
is removed at the next write of the same file (or by `remove_temporary`). Object stores write
whole objects in one call (`pipe_file`: one PUT, or a multipart upload completed only when every
part is sent), so an object is there whole or not at all; there is no rename on S3.

Every OSError of the filesystem (create a directory, write, fsync, rename, list, read, delete)
is raised as a CheckpointError naming the checkpoint, the path and the OS's reason
(``checkpoint ckpt-000000020: cannot write /d/ckpt-000000020/shard-1.safetensors: No space left on
device (ENOSPC)``).

Retention (`prune`) counts verified checkpoints only: those that pass the verdict resume applies
(verdict.py: complete, every file of the size and SHA-256 its manifest names, and every check of
restore's). A damaged checkpoint never counts toward `keep`, so a damaged newer one never makes a
good one go, and the newest one that passes is never deleted. An incremental checkpoint (a
delta: its manifest's shard entries name a ``parent``) counts when its whole chain does, and keeps
its chain (`chain`) from deletion.

Thread-safety: a store may be used from several threads for different files.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import json
import logging
import os
import posixpath
import re
import stat
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from paramserver.base.errors import AlreadyExistsError, FailedPreconditionError, InvalidArgumentError
from paramserver.base.names import checkpoint_name_problem

log = logging.getLogger(__name__)
MANIFEST = "MANIFEST.json"
FORMAT = "paramserver-checkpoint"
FORMAT_VERSION = 1
_PREFIX = "ckpt-"
_TEMPORARY = re.compile(r"^(?P<target>.+)\.tmp-[0-9a-f]+$")  # `<file>.tmp-<hex>`: a write in progress or dead
_CHUNK = 8 << 20  # bytes hashed at a time when a file is verified
MAX_CHAIN = 256  # checkpoints one chain may hold (base + deltas): far above any --checkpoint-base-every
MAX_MANIFEST_BYTES = 16 << 20  # a manifest names one small entry per shard: far below this
Checker = Callable[[IO[bytes], int], None]  # a written file's check: (handle open for reading, its size)


class CheckpointError(FailedPreconditionError):
    """A checkpoint that cannot be written, read or used (or does not fit this model): names the
    checkpoint, the file and the reason (the OS's, for a filesystem error)."""


@dataclass(frozen=True)
class ShardFile:
    index: int
    file: str
    bytes: int
    sha256: str
    parent: str = ""  # the checkpoint this file is a delta on ("": a whole file)


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:09d}"


def is_checkpoint_name(text: object) -> bool:
    """Whether `text` is a checkpoint's name (ckpt-<9 digits>)."""
    return checkpoint_name_problem(text) is None


def shard_file_name(index: int) -> str:
    return f"shard-{index}.safetensors"


def os_reason(exc: OSError) -> str:
    """What the OS said, without the path: 'No space left on device (ENOSPC)'."""
    code = errno.errorcode.get(exc.errno) if isinstance(exc.errno, int) else None
    text = exc.strerror or str(exc) or type(exc).__name__
    return f"{text} ({code})" if code else text


class CheckpointStore:
    """The checkpoints under one directory or URL. `fs`: the filesystem to use instead of the
    URL's (tests give one that fails)."""

    def __init__(self, url: str, fs: fsspec.AbstractFileSystem | None = None) -> None:
        self.url = url
        if fs is None:  # other processes write here: a cached listing (s3fs keeps them) would hide their files
            self.fs, self.root = fsspec.core.url_to_fs(url, use_listings_cache=False)
        else:
            self.fs, self.root = fs, fs._strip_protocol(url)
        self.local = isinstance(self.fs, LocalFileSystem)
        # retention's memory: checkpoints known good (committed here, or hashed once) and known damaged
        self._good: set[str] = set()
        self._damaged: dict[str, str] = {}
        self._passed: dict[str, str] = {}  # checkpoint -> its files' fingerprint, when they passed the verdict

    def path(self, name: str, *parts: str) -> str:
        if not is_checkpoint_name(name):  # names come over the wire: never a path of their own
            raise CheckpointError(f"{name!r} is not a checkpoint name (ckpt-<9 digits>)")
        return posixpath.join(self.root, name, *parts)

    def check_new(self, name: str) -> None:
        """Raise unless `name` may be written by a shard: InvalidArgumentError for what is not a
        checkpoint name, AlreadyExistsError for a committed checkpoint (never overwritten)."""
        if not is_checkpoint_name(name):
            raise InvalidArgumentError(f"{str(name)[:80]!r} is not a checkpoint name (ckpt-<9 digits>)")
        manifest = self.path(name, MANIFEST)
        with self._os("read", manifest, name):
            if self.fs.exists(manifest):
                raise AlreadyExistsError(f"checkpoint {name} is committed in {self.url}: it is never overwritten")

    @contextlib.contextmanager
    def _os(self, action: str, path: str, name: str | None = None, missing: str | None = None) -> Iterator[None]:
        """Raise an OSError of the block as a CheckpointError (the one place this store maps them):
        '[checkpoint NAME: ]cannot ACTION PATH: reason', or, with `missing`, a FileNotFoundError as
        '[checkpoint NAME: ]MISSING'."""
        where = f"checkpoint {name}: " if name else f"checkpoint directory {self.url}: "
        try:
            yield
        except OSError as exc:
            if missing is not None and isinstance(exc, FileNotFoundError):
                raise CheckpointError(f"{where}{missing}") from None
            raise CheckpointError(f"{where}cannot {action} {path}: {os_reason(exc)}") from exc

    def _entries(self, directory: str, name: str | None = None) -> list[str]:
        """The paths in `directory` (none where it does not exist)."""
        with self._os("list", directory, name):
            try:
                return self.fs.ls(directory, detail=False)
            except FileNotFoundError:
                return []

    # ---- writing ---------------------------------------------------------------------------
    def write_shard(self, name: str, index: int, data: bytes) -> ShardFile:
        """Write one shard's file of checkpoint `name` from bytes; returns its manifest entry."""
        return self.write_shard_with(name, index, lambda handle: handle.write(data))

    def write_shard_with(
        self, name: str, index: int, fill: Callable[[IO[bytes]], Any], check: Checker | None = None
    ) -> ShardFile:
        """Write one shard's file of checkpoint `name` by `fill(handle)` (it may seek: the handle
        is a local file); returns its manifest entry, whose size and SHA-256 are read back from
        what was written (a chunk at a time, from the page cache). `check(handle, size)`: run on
        the written file (open for reading) before it takes its name; a CheckpointError it raises
        leaves nothing behind. Local: written under a temporary name, fsynced, renamed. Object
        store: spooled to a local temporary file, checked, then uploaded whole."""
        path = self.path(name, shard_file_name(index))
        if self.local:
            size, digest = self._write_atomic(name, path, fill, check)
        else:
            size, digest = self._upload(name, path, fill, check)
        return ShardFile(index, shard_file_name(index), size, digest)

    def commit(self, name: str, manifest: dict[str, Any]) -> None:
        """Write the manifest (the commit point) of a checkpoint whose shard files are written."""
        body = {"format": FORMAT, "version": FORMAT_VERSION, "name": name, "time": time.time(), **manifest}
        checked = self.passed(name, body)
        self._forget(name)
        self._write_bytes(name, self.path(name, MANIFEST), json.dumps(body, indent=1, sort_keys=True).encode())
        if checked:  # it passed the verdict before its commit (checkpoint/verdict.py): sizes are checked at prune
            self._good.add(name)
            self.note_passed(name, body)

    def mark_final(self, name: str) -> None:
        """Add ``"final": true`` to the manifest of committed checkpoint `name` (the final one of a
        run that was written as a periodic one), rewriting it atomically; its shard files and time
        stay. A manifest without the field (older ones too) is not final."""
        manifest = self.manifest(name)
        if manifest.get("final") is True:
            return
        body = json.dumps({**manifest, "final": True}, indent=1, sort_keys=True).encode()
        self._write_bytes(name, self.path(name, MANIFEST), body)

    def uncommit(self, name: str) -> bool:
        """Remove the manifest of checkpoint `name` if it has one (before its files are written
        again): from then on it is incomplete. Returns whether there was one."""
        path = self.path(name, MANIFEST)
        self._forget(name)
        with self._os("remove", path, name):
            if not self.fs.exists(path):
                return False
            self.fs.rm(path)
            if self.local:
                _fsync_directory(posixpath.dirname(path))  # the removal itself survives a crash
        return True

    def discard(self, name: str) -> bool:
        """Delete checkpoint `name` if it is incomplete (no manifest): what a failed write left
        (files written before another failed). A complete one is left alone. Returns whether
        anything was deleted."""
        directory = self.path(name)
        self._forget(name)
        with self._os("delete", directory, name):
            if not self.fs.exists(directory) or self.fs.exists(self.path(name, MANIFEST)):
                return False
            self.fs.rm(directory, recursive=True)
        return True

    def remove_temporary(self, name: str | None = None) -> list[str]:
        """Delete the temporary files (``<file>.tmp-<hex>``) under checkpoint `name`, or under every
        checkpoint: writes that died. Only when no write is under way. Returns their paths.
        On S3, what a dead writer leaves is an unfinished multipart upload instead (invisible, but
        stored and billed): those under this directory are aborted."""
        removed = [] if self.local else self._abort_uploads(name)
        for checkpoint in [name] if name is not None else self.names():
            removed += self._remove_temporary(checkpoint, self.path(checkpoint))
        return removed

    def _abort_uploads(self, name: str | None) -> list[str]:
        """Abort the unfinished multipart uploads under checkpoint `name` (every checkpoint: None),
        on a filesystem that has them (s3fs); returns their paths."""
        if not hasattr(self.fs, "list_multipart_uploads"):
            return []
        bucket, _, base = self.root.partition("/")
        head = f"{base.rstrip('/')}/" if base else ""
        aborted = []
        with self._os("abort the unfinished uploads under", self.path(name) if name else self.root, name):
            for upload in self.fs.list_multipart_uploads(bucket):
                key = upload["Key"]
                checkpoint = key[len(head) :].split("/")[0] if key.startswith(head) else ""
                if is_checkpoint_name(checkpoint) and name in (None, checkpoint):
                    self.fs.abort_mpu(bucket, key, upload["UploadId"])
                    aborted.append(f"{bucket}/{key}")
        if aborted:
            log.info("aborted %d unfinished upload(s) a killed write left: %s", len(aborted), ", ".join(aborted))
        return aborted

    def prune(self, keep: int, protect: str | None = None) -> list[str]:
        """Delete what is older than the newest `keep` verified checkpoints: older checkpoints,
        complete or not. Damaged ones do not count (fewer than `keep` verified: nothing is
        deleted), and damaged ones newer than those kept stay (`checkpoint list` flags them).
        A delta counts when every checkpoint of its chain does, and those stay while it does (a
        chain is never broken). `protect`: a checkpoint never deleted (the one just written).
        Returns the names deleted."""
        if keep < 1:
            return []
        kept: list[str] = []
        needed: set[str] = set()
        for name in reversed(self.complete()):
            if len(kept) == keep:
                break
            chain = self._chain_counts(name)
            if chain:
                kept.append(name)
                needed.update(chain)
        if len(kept) < keep:
            return []
        doomed = [name for name in self.names() if name < kept[-1] and name != protect and name not in needed]
        for name in doomed:
            self._forget(name)
            with self._os("delete", self.path(name), name):
                self.fs.rm(self.path(name), recursive=True)
        return doomed

    def parent(self, name: str) -> str | None:
        """The checkpoint that checkpoint `name`'s delta files are written on (None: a base)."""
        parents = {entry.parent for entry in self.shard_files(name, self.manifest(name)) if entry.parent}
        if len(parents) > 1:
            raise CheckpointError(f"checkpoint {name}: {MANIFEST} names several parents {sorted(parents)}")
        return parents.pop() if parents else None

    def chain(self, name: str) -> list[str]:
        """Checkpoint `name` and the ones it needs, newest first: its parent, the parent's, .. its base."""
        links = [name]
        while (parent := self.parent(links[-1])) is not None:
            if len(links) >= MAX_CHAIN:
                raise CheckpointError(f"checkpoint {name}: a chain of more than {MAX_CHAIN} checkpoints")
            links.append(parent)
        return links

    def strays_after(self, name: str) -> list[str]:
        """Incomplete checkpoints newer than `name`: after the chief committed `name`, what no write of
        its own left (its names only grow) but a Checkpoint call with a name ahead of its step did."""
        complete = set(self.complete())
        return [other for other in self.names() if other > name and other not in complete]

    def _chain_counts(self, name: str) -> list[str]:
        """Checkpoint `name`'s chain when every checkpoint of it counts (see `_counts`), else []."""
        try:
            chain = self.chain(name)
        except CheckpointError as exc:
            if name not in self._damaged:
                log.warning("%s does not count toward the checkpoints kept: %s", name, exc)
            self._damaged[name] = str(exc)
            return []
        return chain if all(self._counts(link) for link in chain) else []

    def _counts(self, name: str) -> bool:
        """Whether checkpoint `name` counts for retention: it passes the verdict that resume
        applies (checkpoint/verdict.py). One this store committed after it passed, or that passed
        here before, is checked by its files' sizes; any other is checked whole. Damage is logged once."""
        if name in self._damaged:
            return False
        try:
            if name in self._good:
                manifest = self.manifest(name)
                for entry in self.shard_files(name, manifest):
                    self._check_size(name, entry)
            else:
                _verdict()(self, name)
        except CheckpointError as exc:
            self._good.discard(name)
            self._damaged[name] = str(exc)
            log.warning("%s is damaged and does not count toward the checkpoints kept: %s", name, exc)
            return False
        self._good.add(name)
        return True

    def _forget(self, name: str) -> None:
        self._good.discard(name)
        self._damaged.pop(name, None)
        self._passed.pop(name, None)

    def note_passed(self, name: str, manifest: dict[str, Any]) -> None:
        """Remember that checkpoint `name`, with the files `manifest` names, passed every check
        (checkpoint/verdict.py): its files are not read again by this store (files never change)."""
        self._passed[name] = _fingerprint(manifest)

    def passed(self, name: str, manifest: dict[str, Any]) -> bool:
        """Whether checkpoint `name` with the files `manifest` names passed every check here."""
        return self._passed.get(name) == _fingerprint(manifest)

    def _write_bytes(self, name: str, path: str, data: bytes) -> None:
        if not self.local:
            self._put_whole(name, path, data)
        else:
            self._write_atomic(name, path, lambda handle: handle.write(data))

    def _put_whole(self, name: str, path: str, data: bytes) -> None:
        directory = posixpath.dirname(path)
        with self._os("create directory", directory, name):
            self.fs.makedirs(directory, exist_ok=True)
        # One call with the whole object: S3 stores a PUT (or a completed multipart upload)
        # whole or not at all. Not open()/write(): its close() on an error would complete a
        # multipart upload with the parts sent so far, a truncated object.
        try:
            with self._os("write", path, name):
                self.fs.pipe_file(path, data)
        except CheckpointError:
            self._remove_quietly(path)  # a filesystem that writes in place may hold part of it
            raise

    def _upload(
        self, name: str, path: str, fill: Callable[[IO[bytes]], Any], check: Checker | None = None
    ) -> tuple[int, str]:
        """Spool a file locally, then upload it in one call (`put_file`: one PUT, or a multipart
        upload completed only when every part is sent, aborted on failure)."""
        directory = posixpath.dirname(path)
        with self._os("create directory", directory, name):
            self.fs.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(prefix="paramserver-spool-") as spool:
            with self._os("write", spool.name, name):
                fill(spool)
                spool.flush()
            with self._os("read", spool.name, name):
                size, digest = _digest(spool.name)
                _run_check(check, spool.name, size)
            try:
                with self._os("write", path, name):
                    self.fs.put_file(spool.name, path)
            except CheckpointError:
                self._remove_quietly(path)
                raise
        return size, digest

    def _write_atomic(
        self, name: str, path: str, fill: Callable[[IO[bytes]], Any], check: Checker | None = None
    ) -> tuple[int, str]:
        """Write a local file under a temporary name, fsync, `check`, rename; returns its size and SHA-256."""
        directory = posixpath.dirname(path)
        with self._os("create directory", directory, name):
            self.fs.makedirs(directory, exist_ok=True)
        try:  # a dead writer's temporary files of this file
            self._remove_temporary(name, directory, posixpath.basename(path))
        except CheckpointError as exc:
            log.warning("%s", exc)  # the write may still succeed; the next one tries again
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with self._os("write", tmp, name), self.fs.open(tmp, "wb") as handle:
                fill(handle)
                handle.flush()
                with self._os("fsync", tmp, name):
                    os.fsync(handle.fileno())
            with self._os("read", tmp, name):
                size, digest = _digest(tmp)
                _run_check(check, tmp, size)
            with self._os(f"rename {tmp} to", path, name):
                os.replace(tmp, path)
        except CheckpointError:
            self._remove_quietly(tmp)
            raise
        with self._os("fsync directory", directory, name):
            _fsync_directory(directory)  # the rename itself survives a crash
        return size, digest

    def _remove_temporary(self, name: str, directory: str, target: str | None = None) -> list[str]:
        """Delete the temporary files in `directory` (those of `target` only, when given)."""
        removed: list[str] = []
        for entry in self._entries(directory, name):
            match = _TEMPORARY.fullmatch(posixpath.basename(entry.rstrip("/")))
            if match and (target is None or match.group("target") == target):
                with self._os("delete", entry, name):
                    self.fs.rm(entry)
                removed.append(entry)
        if removed:
            log.info(
                "checkpoint %s: removed %d temporary file(s) a failed or killed write left: %s",
                name,
                len(removed),
                ", ".join(posixpath.basename(entry) for entry in removed),
            )
        return removed

    def _remove_quietly(self, path: str) -> None:
        """Delete what a failed write left at `path`; a failure is logged (the next write of the
        same file, or `remove_temporary`, tries again)."""
        try:
            if self.fs.exists(path):
                self.fs.rm(path)
        except OSError as exc:
            log.warning("cannot delete %s after a failed write: %s", path, os_reason(exc))

    # ---- reading ---------------------------------------------------------------------------
    def exists(self) -> bool:
        """Whether the checkpoint directory exists (raises CheckpointError when it is not a
        directory, or cannot be read)."""
        with self._os("read", self.root):
            if self.fs.isdir(self.root):
                return True
            if not self.fs.exists(self.root):
                return False
        raise CheckpointError(f"checkpoint directory {self.url} is not a directory")

    def require(self) -> None:
        """Raise a CheckpointError naming the directory unless it exists."""
        if not self.exists():
            raise CheckpointError(f"checkpoint directory {self.url} does not exist")

    def names(self) -> list[str]:
        """Names of every checkpoint directory here, committed or not, oldest first (a directory
        whose name is not a checkpoint name is not one)."""
        names = [posixpath.basename(entry.rstrip("/")) for entry in self._entries(self.root)]
        return sorted(name for name in names if is_checkpoint_name(name))

    def complete(self) -> list[str]:
        """Names of checkpoints with a manifest, oldest first."""
        names = []
        for name in self.names():
            with self._os("read", self.path(name, MANIFEST), name):
                if self.fs.exists(self.path(name, MANIFEST)):
                    names.append(name)
        return names

    def check_manifest(self, name: str, manifest: dict[str, Any]) -> dict[str, Any]:
        """The manifest that `commit(name, manifest)` would write, as restore would read it back
        (refused as `manifest` refuses it): to check a checkpoint before it is committed."""
        body = {"format": FORMAT, "version": FORMAT_VERSION, "name": name, **manifest}
        try:
            text = json.dumps(body, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {name}: its manifest cannot be written as JSON ({exc})") from None
        if len(text) > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"checkpoint {name}: {MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
        return self._checked_manifest(name, json.loads(text))

    def manifest_bytes(self, name: str) -> bytes:
        """The bytes of checkpoint `name`'s MANIFEST.json (at most MAX_MANIFEST_BYTES; memory: its size)."""
        path = self.path(name, MANIFEST)
        with self._os("read", path, name, missing=f"no {MANIFEST} (incomplete checkpoint)"):
            size = self._regular_size(name, path)
            if size > MAX_MANIFEST_BYTES:
                raise CheckpointError(f"checkpoint {name}: {MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
            with self.fs.open(path, "rb") as handle:  # read(n) allocates n bytes first: the size, not the bound
                data = handle.read(size + 1)
        if len(data) != size:
            raise CheckpointError(f"checkpoint {name}: {MANIFEST} changed while it was read")
        return data

    def manifest(self, name: str) -> dict[str, Any]:
        try:
            manifest = json.loads(self.manifest_bytes(name))
        except (ValueError, RecursionError) as exc:  # RecursionError: nested past the parser's depth
            raise CheckpointError(f"checkpoint {name}: {MANIFEST} is not valid JSON ({exc})") from None
        return self._checked_manifest(name, manifest)

    @staticmethod
    def _checked_manifest(name: str, manifest: Any) -> dict[str, Any]:
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {name}: {MANIFEST} is not a {FORMAT} manifest")
        if manifest.get("version") != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {name}: format version {manifest.get('version')} is not {FORMAT_VERSION}"
            )
        return manifest

    def shard_files(self, name: str, manifest: dict[str, Any]) -> list[ShardFile]:
        try:
            entries = [
                ShardFile(int(e["index"]), str(e["file"]), int(e["bytes"]), str(e["sha256"]), str(e.get("parent", "")))
                for e in manifest["shards"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {name}: {MANIFEST} has a bad shard list ({exc})") from None
        for entry in entries:  # a manifest is not trusted: its files are this checkpoint's own, by name
            if entry.file != shard_file_name(entry.index) or entry.bytes < 0:
                raise CheckpointError(
                    f"checkpoint {name}: {MANIFEST} names {entry.file[:80]!r} ({entry.bytes} bytes) for shard "
                    f"{entry.index}, not {shard_file_name(entry.index)}"
                )
        for entry in entries:  # a delta's parent is an earlier checkpoint of this directory, by name
            if entry.parent and not (is_checkpoint_name(entry.parent) and entry.parent < name):
                raise CheckpointError(
                    f"checkpoint {name}: {MANIFEST} names {entry.parent[:80]!r} as the parent of {entry.file}, "
                    "not an earlier checkpoint"
                )
        if sorted(entry.index for entry in entries) != list(range(len(entries))):
            raise CheckpointError(f"checkpoint {name}: {MANIFEST} does not name shards 0..{len(entries) - 1} once each")
        if not entries or manifest.get("num_shards", len(entries)) != len(entries):
            raise CheckpointError(
                f"checkpoint {name}: {MANIFEST} names {len(entries)} shard files for "
                f"{manifest.get('num_shards')} shards"
            )
        return entries

    def verify(self, name: str) -> dict[str, Any]:
        """Check that checkpoint `name` is complete and that every shard file has the size and
        SHA-256 its manifest names (reading each file through once, a chunk at a time). Returns
        the manifest; raises CheckpointError naming the file and what is wrong with it."""
        manifest = self.manifest(name)
        for entry in self.shard_files(name, manifest):
            self.verify_file(name, entry)
        return manifest

    def verify_file(self, name: str, entry: ShardFile) -> None:
        """Check one shard file's size and SHA-256 against its manifest entry (the size first,
        then the bytes a chunk at a time)."""
        self._check_size(name, entry)
        digest, size = hashlib.sha256(), 0
        with self.open_shard(name, entry) as handle, self._os("read", self.path(name, entry.file), name):
            while chunk := handle.read(min(_CHUNK, entry.bytes + 1 - size)):
                digest.update(chunk)
                size += len(chunk)
        self.check_digest(name, entry, size, digest.hexdigest())

    def check_size(self, name: str, entry: ShardFile) -> None:
        """Check one shard file's size against its manifest entry (no read)."""
        self._check_size(name, entry)

    @contextlib.contextmanager
    def open_shard(self, name: str, entry: ShardFile) -> Iterator[Any]:
        """An open binary handle (seek, read) of one shard file, a regular file inside the
        checkpoint's directory; OSErrors as CheckpointErrors."""
        path = self.path(name, entry.file)
        with self._os("read", path, name, missing=_missing(entry)):
            self._regular_size(name, path)
            handle = self.fs.open(path, "rb")
        with handle:
            yield handle

    def _check_size(self, name: str, entry: ShardFile) -> None:
        path = self.path(name, entry.file)
        with self._os("read", path, name, missing=_missing(entry)):
            size = self._regular_size(name, path)
        self.check_digest(name, entry, size, None)

    def _regular_size(self, name: str, path: str) -> int:
        """The size of `path`, which must be a regular file inside checkpoint `name`'s directory:
        locally, a link to elsewhere (another directory, /dev/zero) is refused before any read."""
        if not self.local:
            return int(self.fs.size(path))
        status = os.lstat(path)  # a regular file, not a link: in its directory (one call, at every open)
        if stat.S_ISREG(status.st_mode):
            return status.st_size
        real = os.path.realpath(path)
        status = os.stat(real)
        if os.path.dirname(real) != os.path.realpath(self.path(name)) or not stat.S_ISREG(status.st_mode):
            raise CheckpointError(
                f"checkpoint {name}: {posixpath.basename(path)} is not a regular file in the checkpoint's directory"
            )
        return status.st_size

    @staticmethod
    def check_digest(name: str, entry: ShardFile, size: int, sha256: str | None) -> None:
        """Raise unless a file read back as `size` bytes (and `sha256`, when given) is `entry`."""
        if size != entry.bytes:
            raise CheckpointError(
                f"checkpoint {name}: shard file {entry.file} has {size} bytes, the manifest "
                f"says {entry.bytes} (truncated?)"
            )
        if sha256 is not None and sha256 != entry.sha256:
            raise CheckpointError(
                f"checkpoint {name}: shard file {entry.file} does not match its SHA-256 (changed after it was written)"
            )


def _missing(entry: ShardFile) -> str:
    return f"shard file {entry.file} named by the manifest is missing"


def _verdict() -> Callable[[CheckpointStore, str], None]:
    """checkpoint/verdict.py's check_checkpoint. Bound late, by name: the verdict is restore's own
    check, which reads checkpoints through this module, so this module cannot import it."""
    return importlib.import_module(f"{__package__}.verdict").check_checkpoint


def _fingerprint(manifest: dict[str, Any]) -> str:
    """What names a checkpoint's files: its manifest's shard entries (each file's size and SHA-256)."""
    return hashlib.sha256(json.dumps(manifest.get("shards"), sort_keys=True, default=str).encode()).hexdigest()


def _run_check(check: Checker | None, path: str, size: int) -> None:
    if check is not None:
        with open(path, "rb") as handle:
            check(handle, size)


def _digest(path: str) -> tuple[int, str]:
    """Size and SHA-256 of a local file, read a chunk at a time."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _fsync_directory(path: str) -> None:
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
