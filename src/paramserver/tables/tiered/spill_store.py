"""The cold rows of one tiered table, on local disk in RocksDB (rocksdict), keyed by id.

Why RocksDB (measured on this project's machine: 2 cores, virtio disk, ext4; `python bench/tiered.py
stores`, docs/benchmarks/tiered.md): batch get/put of 8-byte keys and 136-byte values at 3M random ids, in
batches of 100k:

  store                       load/s  get/s  update/s  disk B/row           RssAnon  RssFile
  RocksDB, as set up here     566k    158k   320k      247 (144 compacted)  225 MiB  32 MiB
  LMDB 3.0.0 (sync off)       264k    719k   259k      439                  355 MiB  1273 MiB

LMDB reads through mmap: every page it touches is in the process's RSS (RssFile: the whole file
here), so at 200M rows its ~90 GB file would count against the PS; its B-tree also writes 4 KiB
pages at random on every update. RocksDB's memory is bounded and set here: a block cache and
memtables shared by the PS's tables (`StoreMemory`), plus index and bloom filter blocks, about 2
bytes per row on disk. A multi-get holds a block per key while it is served (100k keys took 250 MB
with 16 KiB blocks, measured): gets go 4096 keys at a time, with 4 KiB blocks. Writes are sequential
(an LSM tree), and a bloom filter answers "never stored" (a new id) without a read.

The spill is a cache of the training state, rebuilt from a checkpoint on restart: no write-ahead
log, no fsync, and a store is never reopened (SpillSpace deletes what a dead PS left).
Every failure is reported to the PS's SpillCondition (spill_condition.py): a full disk (rows not
written stay in memory; RocksDB resumes writing once there is room), or anything else (the store
cannot be trusted: the shard is recovered from its checkpoint). A write never waits without
a deadline: RocksDB is asked not to stall it (no_slowdown); a write that would stall is tried again
for WRITE_STALL_S, then fails.
Thread-safety: the owning table serializes its calls (TableStore's lock), and its write-back
thread (write_back.py) calls `put` beside them (RocksDB takes concurrent reads and writes; the
table keeps the two apart where it matters: a row is read from the write-back queue until its
write is done, and `delete`, `scan` and `contains` run once the queue is empty). A get spreads its
multi-gets over READERS threads of the store's own ("spill-read"), and waits for them.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import numpy as np
import rocksdict

from paramserver.base.deadline import Deadline
from paramserver.base.errors import ResourceExhaustedError
from paramserver.tables.row_record import RowRecord
from paramserver.tables.tiered.spill_condition import SpillCondition

log = logging.getLogger(__name__)

GET_BATCH = 4096  # keys per multi-get: each may hold a block (4 KiB) until the batch is served
PUT_BATCH = 65536  # rows per write batch
READERS = 2  # threads of a store that serve a get's multi-gets side by side (a PS has few cores)
WRITE_STALL_S = 30.0  # longest a write is tried again while RocksDB would stall it (flushes behind)
_STALL_PAUSE_S = 0.01
_SIGN = np.uint64(1 << 63)  # big-endian keys with the sign bit flipped: byte order = signed id order


class SpillError(ResourceExhaustedError):
    """The spill store could not read or write (a full disk, an I/O error): names its directory
    and RocksDB's reason. The request fails; rows not written out stay in memory. `full`: the disk
    is full (the store works again once there is room); else the store cannot be trusted."""

    def __init__(self, message: str, full: bool = False) -> None:
        super().__init__(message)
        self.full = full


def _is_full(exc: Exception) -> bool:
    """Whether RocksDB's status says the disk is full (rocksdict gives only its text: ENOSPC's words)."""
    return "No space left on device" in str(exc) or "NoSpace" in str(exc)


def _is_stall(exc: Exception) -> bool:
    """Whether a no_slowdown write was refused because RocksDB would have stalled it (Status::Incomplete)."""
    return "Incomplete" in str(exc) or "incomplete" in str(exc)


class StoreMemory:
    """What the RocksDB stores of one PS share, so that their memory has one bound:
    one block cache and one budget for all memtables."""

    def __init__(self, block_cache_bytes: int = 64 << 20, memtable_bytes: int = 64 << 20) -> None:
        self.block_cache_bytes, self.memtable_bytes = block_cache_bytes, memtable_bytes
        self.cache = rocksdict.Cache(block_cache_bytes)
        self.memtables = rocksdict.WriteBufferManager(memtable_bytes, False)

    @classmethod
    def for_budget(cls, budget: int) -> StoreMemory:
        """A sixteenth of the PS's table budget for each, within [8 MiB, 64 MiB] (the hot rows in
        memory are the real cache: the block cache only spares re-reading index blocks). Not less
        than 8 MiB: with memtables of 1 MiB a small table's store flushed tiny files so often that
        each get probed several of them (a third more CPU per row, measured at an 8 MiB budget)."""
        share = min(max(budget // 16, 8 << 20), 64 << 20)
        return cls(share, share)

    @property
    def nbytes(self) -> int:
        """The bound of both (the index and filter blocks of each store come on top)."""
        return self.block_cache_bytes + self.memtable_bytes


def _options(memory: StoreMemory) -> rocksdict.Options:
    options = rocksdict.Options(raw_mode=True)
    options.create_if_missing(True)
    table = rocksdict.BlockBasedOptions()
    table.set_block_cache(memory.cache)
    table.set_bloom_filter(10, False)  # a full filter per file: ~1% of new ids cost a read
    table.set_block_size(4 << 10)
    options.set_block_based_table_factory(table)
    options.set_write_buffer_manager(memory.memtables)
    options.set_write_buffer_size(min(32 << 20, max(memory.memtable_bytes // 2, 1 << 20)))
    options.set_max_write_buffer_number(2)
    options.set_compression_type(rocksdict.DBCompressionType.none())  # float rows barely compress
    options.set_target_file_size_base(256 << 20)
    options.set_max_open_files(512)
    options.set_max_background_jobs(2)
    return options


def _batch(action: str, *columns: list) -> rocksdict.WriteBatch:
    """A write batch of `action` ("put": keys and values; "delete": keys), filled without a Python loop per row."""
    batch = rocksdict.WriteBatch(raw_mode=True)
    collections.deque(map(getattr(batch, action), *columns), maxlen=0)
    return batch


def keys_of(ids: np.ndarray) -> list:
    """The keys of `ids`, one bytes object each (made by numpy: raw 8-byte items as bytes)."""
    return (np.ascontiguousarray(ids, np.int64).view(np.uint64) ^ _SIGN).astype(">u8").view("V8").tolist()


def values_of(records: np.ndarray) -> list:
    """The records as one bytes object each."""
    return np.ascontiguousarray(records).view(f"V{records.dtype.itemsize}").tolist()


def ids_of(keys: list[bytes]) -> np.ndarray:
    return (np.frombuffer(b"".join(keys), ">u8").astype(np.uint64) ^ _SIGN).view(np.int64)


class SpillStore:
    """Records (row_record.RowRecord) of a table's rows by id, in a RocksDB directory of its own."""

    def __init__(
        self, path: str, record: RowRecord, memory: StoreMemory, condition: SpillCondition | None = None
    ) -> None:
        self.path, self.record = path, record
        self.condition = condition or SpillCondition()
        self._options = _options(memory)
        with self._failing_as_spill_error("open"):
            # the RocksDB handle; a test seam too: tests put a wrapper here whose calls fail like a
            # full or damaged disk (its methods are called from this store and its reader threads)
            self.db = rocksdict.Rdict(path, self._options)
        self._write = rocksdict.WriteOptions()
        self._write.disable_wal = True  # type: ignore[method-assign,assignment]  # a property (the stub says a method)
        self._write.no_slowdown = True  # a stall fails at once: _write_batch tries again, within a deadline
        reads = rocksdict.ReadOptions()
        # a row read moves to memory, so its block is not read again soon: caching it costs an
        # insert and an eviction per read for nothing (takes a bool, though the stub says none)
        reads.fill_cache(False)  # type: ignore[call-arg]
        self.db.set_read_options(reads)
        self.reads = self.writes = 0  # rows read from and written to disk
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="spill-read")

    @contextlib.contextmanager
    def _failing_as_spill_error(self, action: str) -> Iterator[None]:
        """RocksDB's failures as SpillError, each reported to the condition (full disk, or failed)."""
        if self.condition.failed:  # a store that failed is not touched again
            raise SpillError(f"spill store {self.path}: cannot {action}: {self.condition.cause}")
        try:
            yield
        except SpillError:
            raise
        except Exception as exc:  # rocksdict raises plain Exceptions carrying RocksDB's status
            error = SpillError(f"spill store {self.path}: cannot {action}: {exc}", full=_is_full(exc))
            if error.full:
                self.condition.disk_full(str(error))
            else:
                self.condition.fail(str(error))
            raise error from exc

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found, records): whether each id has a record here, and the records of those found, in order.
        Multi-gets of GET_BATCH keys run READERS at a time (RocksDB reads without holding the GIL)."""
        chunks = [ids[lo : lo + GET_BATCH] for lo in range(0, ids.shape[0], GET_BATCH)]
        answers = list(self._readers.map(self._multi_get, chunks) if len(chunks) > 1 else map(self._multi_get, chunks))
        found = np.concatenate([hits for hits, _ in answers]) if answers else np.zeros(0, bool)
        records = np.frombuffer(b"".join(packed for _, packed in answers), self.record.dtype).copy()
        self.reads += records.shape[0]
        return found, records

    def _multi_get(self, ids: np.ndarray) -> tuple[np.ndarray, bytes]:
        """(found, the records found, packed) of one chunk of ids."""
        with self._failing_as_spill_error("read rows"):
            got = cast(list, self.db.get(keys_of(ids)))
        return np.array([value is not None for value in got], bool), b"".join(filter(None, got))

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self.get(ids)[0]

    def put(self, ids: np.ndarray, records: np.ndarray) -> None:
        """Write (or overwrite) the records of `ids`."""
        for lo in range(0, ids.shape[0], PUT_BATCH):
            keys, values = keys_of(ids[lo : lo + PUT_BATCH]), values_of(records[lo : lo + PUT_BATCH])
            self._write_batch(functools.partial(_batch, "put", keys, values), "write rows")
        self.writes += ids.shape[0]
        self.condition.wrote()

    def delete(self, ids: np.ndarray) -> None:
        for lo in range(0, ids.shape[0], PUT_BATCH):
            keys = keys_of(ids[lo : lo + PUT_BATCH])
            self._write_batch(functools.partial(_batch, "delete", keys), "delete rows")

    def _write_batch(self, batch: Callable[[], rocksdict.WriteBatch], action: str) -> None:
        """Write the batch `batch()` makes; while RocksDB would stall it, try again (for
        WRITE_STALL_S at most) with a new one (a batch refused is consumed all the same)."""
        deadline = Deadline(WRITE_STALL_S)
        with self._failing_as_spill_error(action):
            while True:
                try:
                    self.db.write(batch(), self._write)
                    return
                except Exception as exc:
                    if not _is_stall(exc) or deadline.passed():
                        raise
                time.sleep(_STALL_PAUSE_S)  # RocksDB flushes meanwhile; the deadline above is the verdict

    def scan(self, chunk_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, records) of every row, in id order, `chunk_rows` at a time. The iterator reads one
        point-in-time view: rows written or deleted meanwhile do not change what it yields."""
        iterator = self.db.iter()
        iterator.seek_to_first()
        while iterator.valid():
            keys: list[bytes] = []
            values: list[bytes] = []
            with self._failing_as_spill_error("read rows"):
                while iterator.valid() and len(keys) < chunk_rows:
                    keys.append(iterator.key())
                    values.append(iterator.value())
                    iterator.next()
                iterator.status()  # raises what ended the iteration early, if anything did
            yield ids_of(keys), np.frombuffer(b"".join(values), self.record.dtype)
        del iterator

    def disk_bytes(self) -> int:
        """Bytes of the store's files (live data, and what compaction has not reclaimed yet)."""
        return sum(self.db.property_int_value(p) or 0 for p in ("rocksdb.total-sst-files-size",))

    def memory_bytes(self) -> int:
        """The store's own memory outside the shared cache: index and filter blocks, memtables."""
        return sum(
            self.db.property_int_value(p) or 0
            for p in ("rocksdb.estimate-table-readers-mem", "rocksdb.cur-size-all-mem-tables")
        )

    def close(self, delete: bool = True) -> None:
        """Close the store and, with `delete`, its files (not when its directory may not be its own
        any more: SpillSpace.problem). Never raises: a store that failed is closed as well as it can be."""
        self._readers.shutdown()
        try:
            self.db.close()
        except Exception as exc:
            log.warning("spill store %s: closing: %s", self.path, exc)
        if not delete:
            return
        try:
            rocksdict.Rdict.destroy(self.path, self._options)
        except Exception as exc:
            log.warning("spill store %s: deleting its files: %s", self.path, exc)
