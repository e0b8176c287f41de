"""Where checkpoints live: a directory (local path, NFS, or an fsspec URL such as s3://bucket/run).

Layout: ``<dir>/ckpt-<step:09d>/shard-<i>.safetensors`` (one file per shard) and
``<dir>/ckpt-<step>/MANIFEST.json``, written last. The manifest's presence is the commit: a
checkpoint without one is incomplete and ignored. The manifest names every shard file with its
size and SHA-256, so a truncated, missing or tampered file is found before it is used.

Local writes go to a temporary name, are fsynced, then renamed (and the directory fsynced);
object stores write whole objects, which is atomic there. Thread-safety: a store may be used
from several threads for different files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..base.errors import FailedPreconditionError

log = logging.getLogger(__name__)
MANIFEST = "MANIFEST.json"
FORMAT = "paramserver-checkpoint"
FORMAT_VERSION = 1
_PREFIX = "ckpt-"
_NAME = re.compile(r"^ckpt-\d{9}$")


class CheckpointError(FailedPreconditionError):
    """A checkpoint that cannot be used (or does not fit this model): names the checkpoint and the file."""


@dataclass(frozen=True)
class ShardFile:
    index: int
    file: str
    bytes: int
    sha256: str


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:09d}"


def shard_file_name(index: int) -> str:
    return f"shard-{index}.safetensors"


class CheckpointStore:
    """The checkpoints under one directory or URL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, name: str, *parts: str) -> str:
        if not _NAME.match(name):  # names come over the wire: never a path of their own
            raise CheckpointError(f"{name!r} is not a checkpoint name (ckpt-<9 digits>)")
        return posixpath.join(self.root, name, *parts)

    # ---- writing ---------------------------------------------------------------------------
    def write_shard(self, name: str, index: int, data: bytes) -> ShardFile:
        """Write one shard's file of checkpoint `name`; returns its manifest entry."""
        file = shard_file_name(index)
        self._write_atomic(self.path(name, file), data)
        return ShardFile(index, file, len(data), hashlib.sha256(data).hexdigest())

    def commit(self, name: str, manifest: dict[str, Any]) -> None:
        """Write the manifest (the commit point) of a checkpoint whose shard files are written."""
        body = {"format": FORMAT, "version": FORMAT_VERSION, "name": name, "time": time.time(), **manifest}
        self._write_atomic(self.path(name, MANIFEST), json.dumps(body, indent=1, sort_keys=True).encode())

    def uncommit(self, name: str) -> bool:
        """Remove the manifest of checkpoint `name` if it has one (before its files are written
        again): from then on it is incomplete. Returns whether there was one."""
        path = self.path(name, MANIFEST)
        if not self.fs.exists(path):
            return False
        self.fs.rm(path)
        if self.local:
            _fsync_directory(posixpath.dirname(path))  # the removal itself survives a crash
        return True

    def prune(self, keep: int) -> list[str]:
        """Delete all but the newest `keep` complete checkpoints (and incomplete older ones)."""
        complete = self.complete()
        if keep < 1 or len(complete) <= keep:
            return []
        newest_kept = complete[-keep]
        doomed = [name for name in self._all() if name < newest_kept]
        for name in doomed:
            self.fs.rm(posixpath.join(self.root, name), recursive=True)
        return doomed

    def _write_atomic(self, path: str, data: bytes) -> None:
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        if not self.local:
            with self.fs.open(path, "wb") as handle:  # an object appears whole or not at all
                handle.write(data)
            return
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        _fsync_directory(posixpath.dirname(path))  # the rename itself survives a crash

    # ---- reading ---------------------------------------------------------------------------
    def _all(self) -> list[str]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        names = [posixpath.basename(entry.rstrip("/")) for entry in entries]
        return sorted(name for name in names if _NAME.match(name))

    def complete(self) -> list[str]:
        """Names of checkpoints with a manifest, oldest first."""
        return [name for name in self._all() if self.fs.exists(self.path(name, MANIFEST))]

    def manifest(self, name: str) -> dict[str, Any]:
        path = self.path(name, MANIFEST)
        try:
            with self.fs.open(path, "rb") as handle:
                manifest = json.loads(handle.read())
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {name}: no {MANIFEST} (incomplete checkpoint)") from None
        except ValueError as exc:
            raise CheckpointError(f"checkpoint {name}: {MANIFEST} is not valid JSON ({exc})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {name}: {MANIFEST} is not a {FORMAT} manifest")
        if manifest.get("version") != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {name}: format version {manifest.get('version')} is not "
                                  f"{FORMAT_VERSION}")
        return manifest

    def shard_files(self, name: str, manifest: dict[str, Any]) -> list[ShardFile]:
        try:
            return [ShardFile(int(e["index"]), str(e["file"]), int(e["bytes"]), str(e["sha256"]))
                    for e in manifest["shards"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {name}: {MANIFEST} has a bad shard list ({exc})") from None

    def read_shard(self, name: str, entry: ShardFile) -> bytes:
        """The bytes of one shard file, checked against the manifest's size and SHA-256."""
        path = self.path(name, entry.file)
        try:
            with self.fs.open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {name}: shard file {entry.file} named by the manifest is missing") \
                from None
        if len(data) != entry.bytes:
            raise CheckpointError(f"checkpoint {name}: shard file {entry.file} has {len(data)} bytes, the manifest "
                                  f"says {entry.bytes} (truncated?)")
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise CheckpointError(f"checkpoint {name}: shard file {entry.file} does not match its SHA-256 "
                                  "(changed after it was written)")
        return data


def _fsync_directory(path: str) -> None:
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
