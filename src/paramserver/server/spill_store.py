"""The cold rows of one tiered table, on local disk: a hash table of fixed-size pages in one
memory-mapped file, read and written a whole batch of ids at a time with numpy.

Layout. The file is an array of pages; a page holds up to `slots` rows (48-128: a page is one or
two 4 KiB blocks for usual records, more for big ones): first their ids (int64), then their records
(row_record.RowRecord), used slots first. Which page holds an id is extendible hashing over
mix64(id): a directory (in memory, a power of two of page numbers) is indexed by the hash's top
`_bits` bits; a full page splits in two by the next bit (the directory doubles when a page splits
past its depth). Nothing is rehashed at once: a split moves one page's rows.

In memory, besides the directory: a fingerprint (a byte of the hash, 0 for an empty slot) of every
slot, and each page's row count and depth. A lookup compares an id's fingerprint with its page's
(60 bytes, in memory), then reads the ids of the slots that match (1 in 255 wrongly) from the file:
an id that is not there (a new row) costs no read of the file at all. Memory: about 1.5 bytes a row
on disk for the fingerprints (pages are ~2/3 full), 0.5-1 for the directory (int32; at most 64
times the pages), 2 bytes a page.

A batch (get, put, delete) is a few numpy passes whatever its size: hash, compare fingerprints,
gather or scatter ids and records (raw bytes: a memcpy each). No Python object per row. `get` also
says where each row is, so that writing it back (`put` with those places) needs no lookup unless
it moved (a split or a delete in its page moves rows).

Why not RocksDB (the first design; measured on this project's machine, 2 cores, virtio disk, ext4,
page cache warm): a multi-get of 4096 keys cost 3.1 µs a key (a 4 KiB block copied out of the page
cache per key, index search, checksum, a Python bytes object per key), 2.2 µs with mmap reads, and
a batch write ~1 µs a row in its Python loop, plus compactions. Training with Zipf(1.1) ids reads
about half of each step's distinct rows from disk and writes as many back (the tail of the law:
even a perfect cache of 14% of the rows misses 51% of them), where an in-memory table spends
~0.4 µs a row. Here a cold row costs ~0.15 µs to find and read and ~0.1 µs to write back in place.

Writes through the mapping dirty page-cache pages, which the kernel writes out in the background
(no fsync here). Once it has written a page, the next write to it through the mapping takes a page
fault (the kernel tracks dirtying): 3-6 µs each here, once per page mapped per write-out, about
every 10 s. Mapped 4 KiB at a time, that was 300,000 faults every 10 s at 5M rows, a quarter of a
training run's time. The mapping is therefore left to the kernel's default read-ahead (no
MADV_RANDOM): a file system with large folios (ext4 since Linux 6.16, xfs) then keeps the file in
pieces of up to 2 MiB, mapped whole (FilePmdMapped), and the faults fall to ~15,000 a period
(measured; at 10M rows 70% of the file was mapped so, and faults were ~2,500 a step). Rows are
read at random, so the kernel's read-ahead for mappings soon stops reading ahead of a fault that
misses the page cache (its mmap_miss heuristic). MADV_HUGEPAGE mapped 94% of it so at 10M rows
(+18% rows/s) but makes every fault that misses the page cache read 2 MiB: not used.

Memory and disk. The file's pages live in the kernel's page cache, counted in the process's
RssFile (not RssAnon) while mapped; they are file pages, reclaimable as any page cache is (in a
container with a memory limit the kernel drops them to stay under it). Disk is allocated
(posix_fallocate) in steps of a quarter of the file before use, so that a full disk fails a write
cleanly (SpillError, RESOURCE_EXHAUSTED; rows added by it are taken out again) instead of faulting
on a write through the mapping; the rows that could not be written stay in memory (the table's
concern). The file's size runs ahead of that, up to 8 times: a hole, mapped once, so that the
mapping is rarely replaced (a new mapping starts with no page mapped: every page faults once
more). Pages are never freed: a deleted row's slot is reused by the ids of its page.

The spill is a cache of the training state, rebuilt from a checkpoint on restart: no fsync, no
header, and a store is never reopened (SpillSpace deletes what a dead PS left).
Not thread-safe: the owning table serializes calls (TableStore's lock).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import numpy as np

from ..base.errors import ResourceExhaustedError
from ..base.hashing import mix64
from .row_record import RowRecord

FILE = "rows"
_MIN_SLOTS, _MAX_SLOTS = 48, 128  # rows a page: fewer make the directory bigger, more make a lookup compare more ids
_MIN_PAGES = 16  # the file's first size, in pages
_MAP_GROWTH = 8  # the mapping (and the file's size, a hole past what is allocated) grows 8 times when outgrown
_MAX_DEPTH_OVER = 6  # a directory at most 2^6 times the pages, or 2^22 entries (only ids made to collide go past it)
_MIN_MAX_BITS = 22
_U64 = np.uint64


class SpillError(ResourceExhaustedError):
    """The spill store could not write (a full disk, an I/O error): names its file and the
    reason. The request fails; rows not written out stay in memory."""


def _print(hashes: np.ndarray) -> np.ndarray:
    """An id's fingerprint: the low byte of its hash (the directory takes the top bits), 1 to 255
    (0 marks an empty slot)."""
    return np.maximum((hashes & _U64(0xFF)).astype(np.uint8), np.uint8(1))


def page_geometry(record_bytes: int) -> tuple[int, int]:
    """(page bytes, rows a page) for records of `record_bytes` (plus an 8-byte id each): pages are
    a power of two of bytes up to 4 KiB, or a multiple of 4 KiB, so that they tile the page cache."""
    slot = 8 + record_bytes
    page = 4096
    while page // slot < _MIN_SLOTS:
        page += 4096
    while page > 256 and page // slot > _MAX_SLOTS:
        page //= 2
    return page, min(page // slot, _MAX_SLOTS)


class SpillStore:
    """Records (row_record.RowRecord) of a table's rows by id, in a file of its own under `path`."""

    def __init__(self, path: str, record: RowRecord) -> None:
        self.path, self.record = path, record
        self.page_bytes, self.slots = page_geometry(record.nbytes)
        self._file = os.path.join(path, FILE)
        try:
            self._fd = os.open(self._file, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise SpillError(f"spill store {self._file}: cannot create: {exc}") from exc
        self._map: mmap.mmap | None = None
        self._room = 0  # pages the file holds (allocated on disk)
        self._mapped = 0  # pages mapped (the file's size: those past _room are a hole)
        self._used = 0  # pages in use: 0.._used-1
        self._count = np.zeros(0, np.uint8)  # rows in each page
        self._depth = np.zeros(0, np.uint8)  # hash bits its rows share
        self._prints = np.zeros((0, self.slots), np.uint8)  # a byte of each id's hash, slot by slot
        self._directory = np.zeros(1, np.int32)  # top `_bits` bits of an id's hash -> its page
        self._bits = 0
        self._columns = np.arange(self.slots)
        self._void = np.dtype((np.void, record.nbytes))
        self.rows = 0
        self.reads = self.writes = 0  # rows read from and written to disk
        self._allocate(1)

    # ---- lookups ----------------------------------------------------------------------------
    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(found, records, places): whether each id has a record here, and the records of those
        found and where they are (a hint for `put`), in order."""
        ids = np.ascontiguousarray(ids, np.int64)
        found, pages, slots, _ = self._locate(ids)
        pages, slots = pages[found], slots[found]
        records = self._records[pages, slots].view(self.record.dtype)
        self.reads += records.shape[0]
        return found, records, pages.astype(np.int64) * self.slots + slots

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self._locate(np.ascontiguousarray(ids, np.int64))[0]

    def _locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(found, page, slot, hash) of each id; page and slot mean nothing where not found.
        The fingerprints (in memory) of the id's page point at the slots it may be in (a wrong one:
        1 in 255), the ids there (on disk) tell."""
        hashes = mix64(ids)
        pages = self._directory[self._top_bits(hashes)]
        maybe = np.take(self._prints, pages, axis=0) == _print(hashes)[:, None]  # empty slots: 0, no match
        row, slot = np.divmod(np.flatnonzero(maybe), self.slots)  # all candidates at once
        same = self._ids[pages[row], slot] == ids[row]
        found = np.zeros(ids.shape[0], bool)
        slots = np.zeros(ids.shape[0], np.intp)
        found[row[same]], slots[row[same]] = True, slot[same]
        return found, pages, slots, hashes

    def _top_bits(self, hashes: np.ndarray) -> np.ndarray:
        if self._bits == 0:
            return np.zeros(hashes.shape, np.intp)
        return (hashes >> _U64(64 - self._bits)).astype(np.intp)

    # ---- writes -----------------------------------------------------------------------------
    def put(self, ids: np.ndarray, records: np.ndarray, places: np.ndarray | None = None) -> None:
        """Write (or overwrite) the records of `ids` (distinct). `places`: where `get` found each
        (-1: not known), written there at once if the id is still there (rows move only when a page
        splits or loses rows), else looked up. On a SpillError the store holds the same ids as
        before (those added are taken out again; overwritten ones may hold the new record)."""
        ids = np.ascontiguousarray(ids, np.int64)
        records = np.ascontiguousarray(records, self.record.dtype).view(self._void)
        self.writes += ids.shape[0]
        if places is not None:
            pages, slots = np.divmod(np.maximum(places, 0), self.slots)
            there = (places >= 0) & (self._ids[pages, slots] == ids) & (slots < self._count[pages])
            self._records[pages[there], slots[there]] = records[there]
            if there.all():
                return
            ids, records = ids[~there], records[~there]
        found, pages, slots, hashes = self._locate(ids)
        if found.any():
            self._records[pages[found], slots[found]] = records[found]
        added = ~found
        if added.any():
            self._insert(ids[added], records[added], hashes[added])

    def _insert(self, ids: np.ndarray, records: np.ndarray, hashes: np.ndarray) -> None:
        """Add records of ids not here; a page too full splits, until every one has a slot."""
        placed: list[np.ndarray] = []
        try:
            while ids.shape[0]:
                pages = self._directory[self._top_bits(hashes)]
                order = np.argsort(pages, kind="stable")
                by_page = pages[order]
                first = np.flatnonzero(np.concatenate([[True], by_page[1:] != by_page[:-1]]))
                runs = np.diff(np.append(first, by_page.shape[0]))  # this batch's ids of each page
                base = self._count[by_page[first]].astype(np.int64) - first  # slot = page's count + rank in run
                slot = np.repeat(base, runs) + np.arange(by_page.shape[0])
                fits = slot < self.slots
                took = order[fits]
                self._ids[by_page[fits], slot[fits]] = ids[took]
                self._prints[by_page[fits], slot[fits]] = _print(hashes[took])
                self._records[by_page[fits], slot[fits]] = records[took]
                self._count[by_page[first]] = np.minimum(self._count[by_page[first]] + runs, self.slots)
                self.rows += took.shape[0]
                placed.append(ids[took])
                left = order[~fits]
                if not left.shape[0]:
                    return
                self._split(np.unique(by_page[~fits]))
                ids, records, hashes = ids[left], records[left], hashes[left]
        except SpillError:
            if placed:
                self.delete(np.concatenate(placed))
            raise

    def _split(self, pages: np.ndarray) -> None:
        """Split these full pages in two by the next bit of their rows' hashes."""
        depth = self._depth[pages].astype(np.int64)
        if (depth >= self._bits).any():
            if self._bits >= max(_MIN_MAX_BITS, int(self._used).bit_length() + _MAX_DEPTH_OVER):
                raise SpillError(f"spill store {self._file}: cannot write rows: too many ids share a hash prefix")
            self._directory = np.repeat(self._directory, 2)
            self._bits += 1
        new = self._allocate(pages.shape[0])  # before any change: a full disk leaves the pages as they were
        ids, records, prints = self._ids[pages], self._records[pages], self._prints[pages]
        used = self._columns < self._count[pages][:, None]
        hashes = mix64(ids)
        upper = ((hashes >> (63 - depth)[:, None].astype(_U64)) & _U64(1)).astype(bool)
        self._rewrite(pages, used & ~upper, ids, records, prints)
        self._rewrite(new, used & upper, ids, records, prints)
        self._depth[pages] = self._depth[new] = depth + 1
        # the directory entries of each page: 2^(bits - depth) from a multiple of that; the upper half moves
        span = np.left_shift(1, self._bits - depth)
        start = (self._top_bits(hashes[:, 0]) & ~(span - 1)) + span // 2
        lengths = span // 2
        offsets = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        self._directory[np.repeat(start, lengths) + offsets] = np.repeat(new, lengths).astype(np.int32)

    def delete(self, ids: np.ndarray) -> None:
        """Remove the records of `ids` (those not here are ignored); each page keeps its rows first."""
        found, pages, slots, _ = self._locate(np.ascontiguousarray(ids, np.int64))
        if not found.any():
            return
        touched, which = np.unique(pages[found], return_inverse=True)
        keep = self._columns < self._count[touched][:, None]
        keep[which.reshape(-1), slots[found]] = False
        self._rewrite(touched, keep, self._ids[touched], self._records[touched], self._prints[touched])
        self.rows -= int(found.sum())

    def _rewrite(
        self, pages: np.ndarray, keep: np.ndarray, ids: np.ndarray, records: np.ndarray, prints: np.ndarray
    ) -> None:
        """Fill `pages` (distinct) with the rows `keep` marks (pages x slots) of `ids`, `records`
        and `prints` (copies of pages' contents), in the first slots; the others are empty
        (fingerprint 0: no id matches them)."""
        page, slot = np.nonzero(keep)
        to = np.cumsum(keep, axis=1)[page, slot] - 1
        self._ids[pages[page], to] = ids[page, slot]
        self._records[pages[page], to] = records[page, slot]
        kept = np.zeros(keep.shape, np.uint8)
        kept[page, to] = prints[page, slot]
        self._prints[pages] = kept
        self._count[pages] = keep.sum(1)

    # ---- the file ---------------------------------------------------------------------------
    def _allocate(self, pages: int) -> np.ndarray:
        """`pages` new empty pages (their numbers), the file grown first if it must be."""
        if self._used + pages > self._room:
            self._grow(max(self._used + pages, self._room + self._room // 4, _MIN_PAGES))
        first = self._used
        self._used += pages
        return np.arange(first, first + pages)

    def _grow(self, room: int) -> None:
        """Allocate disk for `room` pages (a full disk: SpillError, nothing changed); map more of the
        file only when the mapping is outgrown (remapping drops every page from the page tables)."""
        if room >= 1 << 31:
            raise SpillError(f"spill store {self._file}: cannot write rows: more than 2^31 pages")
        try:
            os.posix_fallocate(self._fd, self._room * self.page_bytes, (room - self._room) * self.page_bytes)
        except OSError as exc:
            raise SpillError(f"spill store {self._file}: cannot write rows: {exc}") from exc
        if room > self._mapped:
            self._remap(max(room, _MAP_GROWTH * self._mapped))
        self._room = room

    def _remap(self, pages: int) -> None:
        """Map `pages` pages of the file, extending it (a hole: no disk) to that size."""
        os.ftruncate(self._fd, max(pages * self.page_bytes, os.fstat(self._fd).st_size))
        old = self._map
        self._map = mmap.mmap(self._fd, pages * self.page_bytes)
        for name in ("_count", "_depth", "_prints"):  # as many as mapped: zeros take memory once written
            old_array = getattr(self, name)
            array = np.zeros((pages, *old_array.shape[1:]), np.uint8)
            array[: self._mapped] = old_array
            setattr(self, name, array)
        self._mapped = pages
        view = np.frombuffer(self._map, np.uint8).reshape(pages, self.page_bytes)
        # each id, and each record as raw bytes (a gather of raw bytes is a memcpy a record;
        # structured records are copied field by field)
        self._ids = view[:, : 8 * self.slots].view("<i8")  # pages x slots
        records = view[:, 8 * self.slots : self.slots * (8 + self.record.nbytes)]
        self._records = records.reshape(pages, self.slots, self.record.nbytes).view(self._void)[..., 0]
        if old is not None:
            _close_map(old)

    # ---- scans and sizes --------------------------------------------------------------------
    def scan(self, chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, records) of every row, in page order, at most `chunk_rows` at a time (copies).
        Rows deleted from the chunk just yielded do not change what follows; other writes
        meanwhile may (a split moves rows to a new page): the caller keeps the store still."""
        step = max(1, chunk_rows // self.slots)
        for lo in range(0, self._used, step):
            hi = min(lo + step, self._used)
            used = self._columns < self._count[lo:hi][:, None]
            ids, records = self._ids[lo:hi][used], self._records[lo:hi][used].view(self.record.dtype)
            for at in range(0, ids.shape[0], chunk_rows):
                yield ids[at : at + chunk_rows], records[at : at + chunk_rows]

    def disk_bytes(self) -> int:
        """Bytes of disk the store's file takes (what it has allocated)."""
        return os.fstat(self._fd).st_blocks * 512

    def memory_bytes(self) -> int:
        """The store's own memory: its directory, fingerprints and per-page counts, those of
        pages in use (arrays are as long as the mapping, but zeros take no memory until written;
        the pages themselves are in the page cache)."""
        return self._directory.nbytes + self._used * (self.slots + 2)

    def close(self) -> None:
        """Unmap and delete the store's file (the table is not used again)."""
        if self._fd < 0:
            return
        self._ids = self._ids[:0].copy()  # drop the views of the mapping
        self._records = self._records[:0].copy()
        if self._map is not None:
            _close_map(self._map)
            self._map = None
        os.close(self._fd)
        self._fd = -1
        for remove in (lambda: os.unlink(self._file), lambda: os.rmdir(self.path)):
            try:
                remove()
            except OSError:
                pass


def _close_map(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a view of it is still referenced somewhere: unmapped when that goes
        pass
