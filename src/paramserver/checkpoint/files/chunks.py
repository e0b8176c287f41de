"""A shard file's chunk hashes: the SHA-256 of every CHUNK_BYTES of each tensor's data.

A tensor's data is cut into chunks from its first byte (chunk k: bytes k*C .. (k+1)*C of the
tensor, the last one shorter), and each chunk's SHA-256 is recorded in the file's metadata under
the key ``paramserver.chunks``: JSON ``{"bytes": C, "header": hex, "sha256": {tensor: hex}}``, where a
tensor's hex is its chunks' digests concatenated (64 hex digits each; a tensor of no bytes has ""),
and ``header`` the SHA-256 of the rest of the header (`header_digest`: the ``paramserver`` metadata
and every tensor's dtype, shape and place), so that a header that still parses but changed after it
was written is found without reading the whole file. So a reader
checks what it reads and only that: a PS restoring its own shard reads its own file, chunk by
chunk, each hashed before any row of it is used (`ChunkedReader`), instead of hashing every file
of the checkpoint first.

The writer (shard_file.py) writes each tensor's rows in order, so a `Hasher` takes each tensor's
digests as its bytes go by; the header is planned with a placeholder of the same length (zeros)
and written again, hashes in place, once the data is written. A file without the key (written
before chunk hashes) is checked whole against its manifest SHA-256 instead (restore.py).

Nothing read is trusted: the record is parsed strictly (`parse`): a chunk size that is a multiple
of 8 within [MIN_BYTES, MAX_BYTES], a digest string of exactly one digest per chunk of every tensor
with data, and no tensor the file does not hold; a CheckpointError names the file otherwise.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from paramserver.checkpoint.files import values
from paramserver.checkpoint.files.tensor_file import TensorReader, TensorSpec
from paramserver.checkpoint.store import CheckpointError

KEY = "paramserver.chunks"  # the file metadata key of the record
CHUNK_BYTES = 4 << 20  # a tensor's bytes per hash: the most a reader reads that it may not need, per tensor
MIN_BYTES, MAX_BYTES = 4 << 10, 1 << 30  # a chunk size a reader accepts
_DIGEST = 64  # hex digits of one SHA-256
_HEX = re.compile(r"^[0-9a-f]*$")


def count(nbytes: int, chunk: int) -> int:
    """Chunks of a tensor of `nbytes` bytes."""
    return -(-nbytes // chunk)


class Hasher:
    """Each tensor's chunk digests from its bytes, given in order (`add`). Not thread-safe."""

    def __init__(self, tensors: dict[str, int], chunk: int | None = None) -> None:
        """`tensors`: name -> bytes of data, in the file's order; `chunk`: bytes per hash (CHUNK_BYTES)."""
        self.chunk, self.sizes = chunk or CHUNK_BYTES, dict(tensors)
        self._done: dict[str, list[str]] = {name: [] for name in tensors}
        self._at = dict.fromkeys(tensors, 0)  # bytes of each tensor hashed so far
        self._open: dict[str, Any] = {}  # the digest of each tensor's chunk under way

    def placeholder(self) -> str:
        """The record with every digest zero: as long as the final one (`text`)."""
        zeros = {name: "0" * (_DIGEST * count(n, self.chunk)) for name, n in self.sizes.items()}
        return _text(self.chunk, "0" * _DIGEST, zeros)

    def add(self, name: str, offset: int, data: memoryview | bytes) -> None:
        """The next bytes of tensor `name`, at byte `offset` of its data (where the last ended)."""
        if offset != self._at[name]:
            raise CheckpointError(f"tensor {name!r}: bytes at {offset} after {self._at[name]} (not in order)")
        view, used = memoryview(data).cast("B"), 0
        while used < len(view):
            at = self._at[name]
            take = min(len(view) - used, self.chunk - at % self.chunk)
            digest = self._open.setdefault(name, hashlib.sha256())
            digest.update(view[used : used + take])
            used, self._at[name] = used + take, at + take
            if self._at[name] % self.chunk == 0 or self._at[name] == self.sizes[name]:
                self._done[name].append(self._open.pop(name).hexdigest())

    def done(self, name: str) -> int:
        """Bytes of tensor `name` given so far."""
        return self._at[name]

    def digests(self, name: str) -> str:
        return "".join(self._done[name])

    def missing(self) -> str | None:
        """The first tensor not given whole, or None."""
        return next((name for name, n in self.sizes.items() if self._at[name] != n), None)

    def text(self, header: str) -> str:
        """The record, once every tensor was given whole; `header`: `header_digest` of the file."""
        return _text(self.chunk, header, {name: self.digests(name) for name in self.sizes})


def _text(chunk: int, header: str, digests: dict[str, str]) -> str:
    return json.dumps({"bytes": chunk, "header": header, "sha256": digests}, separators=(",", ":"))


def header_digest(meta: str, tensors: dict[str, TensorSpec]) -> str:
    """The SHA-256 of what a file's header says besides its chunk record: the ``paramserver``
    metadata text and each tensor's dtype, shape, start and size (hex)."""
    places = {name: [spec.dtype.str, list(spec.shape), spec.start, spec.nbytes] for name, spec in tensors.items()}
    return hashlib.sha256(json.dumps([meta, places], sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Chunks:
    """A file's chunk record, parsed: the chunk size and each tensor's digests (hex, concatenated)."""

    chunk: int
    sha256: dict[str, str]

    def digest(self, name: str, k: int) -> str:
        return self.sha256[name][k * _DIGEST : (k + 1) * _DIGEST]

    def check_pass(self, hasher: Hasher, tensors: dict[str, TensorSpec], where: str) -> None:
        """Raise for the first chunk whose digest a whole pass over the file (`hasher`) found other
        than recorded."""
        for name, recorded in self.sha256.items():
            found = hasher.digests(name)
            for k in range(len(recorded) // _DIGEST):
                if found[k * _DIGEST : (k + 1) * _DIGEST] != self.digest(name, k):
                    raise mismatch(where, tensors[name], name, k, self.chunk)


def mismatch(where: str, spec: TensorSpec, name: str, k: int, chunk: int) -> CheckpointError:
    """The error for chunk `k` of tensor `name` (of `spec`) not matching its recorded SHA-256."""
    end = min((k + 1) * chunk, spec.nbytes)
    return CheckpointError(
        f"{where}: tensor {name!r} does not match its SHA-256 at chunk {k} "
        f"(bytes {k * chunk}..{end} of it: changed after it was written)"
    )


def parse(text: str | None, meta: str | None, tensors: dict[str, TensorSpec], where: str) -> Chunks | None:
    """The chunk record `text` of a file whose ``paramserver`` metadata is `meta` and which holds
    `tensors` (None: the file has none), checked, with the header digest it records."""
    if text is None:
        return None
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):
        record = None
    chunk = record.get("bytes") if isinstance(record, dict) else None
    digests = record.get("sha256") if isinstance(record, dict) else None
    if type(chunk) is not int or not MIN_BYTES <= chunk <= MAX_BYTES or chunk % 8 or not isinstance(digests, dict):
        raise CheckpointError(f"{where}: its chunk hashes ({KEY}) are malformed")
    for name, spec in tensors.items():
        found = digests.get(name, "" if not spec.nbytes else None)
        if not isinstance(found, str) or len(found) != _DIGEST * count(spec.nbytes, chunk) or not _HEX.match(found):
            raise CheckpointError(f"{where}: its chunk hashes ({KEY}) do not cover tensor {name!r}")
    if set(digests) - set(tensors):
        raise CheckpointError(f"{where}: its chunk hashes ({KEY}) name a tensor it does not hold")
    if record.get("header") != header_digest(meta or "", tensors):
        raise CheckpointError(f"{where}: its header does not match its SHA-256 (changed after it was written)")
    return Chunks(chunk, {name: digests.get(name, "") for name in tensors})


class ChunkedReader(TensorReader):
    """A TensorReader that reads whole chunks, each checked against its recorded SHA-256 (and its
    values, values.py) before any of it is used; the last chunk read of each tensor is kept, so
    reading a tensor's rows in order reads each chunk once. Memory: a chunk per tensor read.
    Not thread-safe (one handle, one position)."""

    def __init__(
        self,
        handle: IO[bytes],
        size: int,
        where: str,
        tensors: dict[str, TensorSpec],
        chunks: Chunks,
        allow_non_finite: bool,
    ) -> None:
        super().__init__(handle, size, where, tensors)
        self.chunks, self.allow_non_finite = chunks, allow_non_finite
        self._kept: dict[str, tuple[int, bytes]] = {}  # tensor -> (chunk, its bytes), checked
        self.bytes_read = 0

    def read(self, name: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows lo..hi (axis 0) of tensor `name`, a fresh writable array, from checked chunks."""
        spec = self.tensors.get(name)
        if spec is None:
            raise CheckpointError(f"{self.where}: no tensor {name!r}")
        rows = spec.shape[0] if spec.shape else 1
        hi = rows if hi is None else min(hi, rows)
        lo = min(max(lo, 0), hi)
        out = np.empty(((hi - lo),) + spec.shape[1:] if spec.shape else (), spec.dtype)
        view = out.reshape(-1).view(np.uint8)
        start, stop, size = lo * spec.row_bytes, hi * spec.row_bytes, self.chunks.chunk
        for k in range(start // size, count(stop, size)):
            data = self._chunk(name, spec, k)
            a, b = max(start, k * size), min(stop, (k + 1) * size)
            view[a - start : b - start] = np.frombuffer(data, np.uint8, b - a, a - k * size)
        return out

    def _chunk(self, name: str, spec: TensorSpec, k: int) -> bytes:
        kept = self._kept.get(name)
        if kept is not None and kept[0] == k:
            return kept[1]
        size = self.chunks.chunk
        n = min(size, spec.nbytes - k * size)
        self.handle.seek(spec.start + k * size)
        data = self.handle.read(n)
        if len(data) != n:
            raise CheckpointError(f"{self.where}: ends inside tensor {name!r}")
        self.bytes_read += n
        if hashlib.sha256(data).hexdigest() != self.chunks.digest(name, k):
            raise mismatch(self.where, spec, name, k, size)
        problem = values.problem(name, np.frombuffer(data, spec.dtype), self.allow_non_finite)
        if problem is not None:
            raise CheckpointError(f"{self.where}: {problem}")
        self._kept[name] = (k, data)
        return data
