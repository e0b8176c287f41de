"""A tiered table writes the rows it drops from memory on a thread of its own (write_back.py): a
bounded queue that a request waits on only when it is full, read while rows wait in it, stopped
when the table closes; a writer's failure is the next call's clear error, never a hang."""

import threading
import time

import numpy as np
import pytest

from paramserver.tables.embedding_table import EmbeddingTable, RowPolicy
from paramserver.tables.sparse_optimizers import build_sparse_optimizer
from paramserver.tables.tiered.spill_condition import FAILED, FULL, OK
from paramserver.tables.tiered.spill_store import SpillError
from paramserver.tables.tiered.tiers import Tiers
from paramserver.tables.tiered.write_back import QUEUE_SLICES

BUDGET = 128 << 10  # about 800 rows of dim 8 in memory: slices of 50 rows, 200 queued at most
INIT = {"kind": "normal", "std": 0.1}
ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}


class GatedDb:
    """The store's RocksDB, its writes held at a gate (opened a write at a time) or failing."""

    def __init__(self, real):
        self.real, self.error, self.delay_s = real, None, 0.0
        self.gate = threading.Semaphore(0)
        self.gated = False
        self.writes = 0

    def write(self, batch, options):
        if self.gated and not self.gate.acquire(timeout=30):
            raise Exception("test gate never opened")
        time.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        self.writes += 1
        return self.real.write(batch, options)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture
def tiers(tmp_path):
    tiers = Tiers.create(BUDGET, str(tmp_path / "spill"), 0)
    yield tiers
    tiers.close()


def tiered(tiers, policy=None):
    table = tiers.new_table("t", 8, build_sparse_optimizer(ADAGRAD), INIT, ADAGRAD, policy or RowPolicy())
    db = GatedDb(table.store.db)
    table.store.db = db
    return table, db


def fill(table, lo, hi):
    """New rows lo..hi-1, a slice's worth at a time (each read drops one slice's rows)."""
    step = table.write_back.slice_rows
    for start in range(lo, hi, step):
        table.read(np.arange(start, min(start + step, hi), dtype=np.int64))


def in_thread(work):
    """Run `work` on a thread; returns (thread, what it raised, if anything)."""
    raised = []

    def run():
        try:
            work()
        except Exception as exc:
            raised.append(exc)

    thread = threading.Thread(target=run, name="test-request", daemon=True)
    thread.start()
    return thread, raised


def test_a_request_waits_only_while_the_queue_is_full_and_then_for_one_slice(tiers):
    table, db = tiered(tiers)
    back = table.write_back
    fill(table, 0, table.hot.capacity)  # memory full, nothing written yet
    assert back.rows == 0 and db.writes == 0
    db.gated = True  # the writer writes nothing until the gate opens
    started = time.monotonic()
    fill(table, 10_000, 10_000 + back.max_rows)  # room for these: queued, no request waits
    assert time.monotonic() - started < 5 and back.rows == back.max_rows == QUEUE_SLICES * back.slice_rows
    assert db.writes == 0
    request, raised = in_thread(lambda: table.read(np.arange(20_000, 20_000 + back.slice_rows, dtype=np.int64)))
    request.join(0.5)
    assert request.is_alive() and back.rows == back.max_rows  # the queue is full: the request waits
    db.gate.release()  # one slice written: room for the request's
    request.join(10)
    assert not request.is_alive() and not raised
    assert back.rows == back.max_rows and db.writes == 1  # it waited for that one slice only
    for _ in range(QUEUE_SLICES):
        db.gate.release()
    back.drain()
    assert back.rows == 0 and db.writes == 1 + QUEUE_SLICES


def test_rows_read_while_queued_or_written_train_bit_for_bit_as_in_memory(tiers):
    seed = 7
    print("seed", seed)
    rng = np.random.default_rng(seed)
    table, db = tiered(tiers)
    db.delay_s = 0.002  # a slow disk: rows wait in the queue while they are read and dropped again
    memory = EmbeddingTable("t", 8, build_sparse_optimizer(ADAGRAD), INIT, ADAGRAD)
    queued_reads = 0
    for _ in range(150):
        ids = np.unique(rng.integers(0, 3000, 300))
        queued_reads += int(table.write_back.find(ids[table.hot.find(ids) < 0])[0].sum())
        np.testing.assert_array_equal(table.read(ids), memory.read(ids))
        grads = rng.standard_normal((ids.shape[0], 8)).astype(np.float32)
        table.apply(ids, grads)
        memory.apply(ids, grads)
    assert queued_reads > 0  # rows did come back from the queue
    every = np.arange(3000, dtype=np.int64)
    every = np.arange(2000, dtype=np.int64)
    np.testing.assert_array_equal(table.read(every), memory.read(every))
    assert table.size == memory.size and table.describe()["disk_rows"] > 0


def test_the_writer_thread_is_named_and_stops_when_the_tiers_close(tmp_path):
    tiers = Tiers.create(BUDGET, str(tmp_path / "spill"), 0)
    table, db = tiered(tiers)
    fill(table, 0, 3000)
    writer = [t for t in threading.enumerate() if t.name == "spill-write-t"]
    assert len(writer) == 1 and writer[0].is_alive()
    db.gated = True
    fill(table, 5000, 5000 + table.write_back.slice_rows)  # a slice waits at the gate
    # room for every write queued: on a loaded machine slices of the first fill may still be queued too
    for _ in range(3 * QUEUE_SLICES + 10):
        db.gate.release()
    tiers.close()
    assert not writer[0].is_alive() and not table.write_back.running


def test_a_writer_that_fails_makes_the_next_call_raise_a_clear_error_not_hang(tiers):
    table, db = tiered(tiers)
    fill(table, 0, table.hot.capacity)
    db.error = Exception("IO error: Corruption: block checksum mismatch in 000009.sst")
    fill(table, 10_000, 10_000 + table.write_back.slice_rows)  # queued: the writer fails on it
    deadline = time.monotonic() + 10
    while tiers.condition.state != FAILED and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tiers.condition.state == FAILED
    started = time.monotonic()
    for call in (lambda: table.read(np.arange(5, dtype=np.int64)), lambda: table.apply(np.arange(5), np.ones((5, 8)))):
        with pytest.raises(SpillError, match="cannot write rows: .*checksum mismatch") as raised:
            call()
        assert not raised.value.full
    assert time.monotonic() - started < 1


def test_a_writer_that_breaks_fails_the_store_and_the_next_call(tiers):
    table, _ = tiered(tiers)
    fill(table, 0, table.hot.capacity)

    def broken(ids, records):
        raise RuntimeError("a bug in the writer")

    table.store.put = broken
    fill(table, 10_000, 10_000 + table.write_back.slice_rows)
    deadline = time.monotonic() + 10
    while table.write_back.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tiers.condition.state == FAILED and "its writer failed: RuntimeError" in tiers.condition.cause
    with pytest.raises(SpillError, match="its writer failed: RuntimeError.*a bug in the writer"):
        table.read(np.arange(10_000, 10_010, dtype=np.int64))


def test_while_the_disk_is_full_queued_rows_answer_and_a_request_needing_room_fails_then_goes_on(tiers):
    table, db = tiered(tiers)
    memory = EmbeddingTable("t", 8, build_sparse_optimizer(ADAGRAD), INIT, ADAGRAD)
    for lo in range(0, 2000, 100):
        ids = np.arange(lo, lo + 100, dtype=np.int64)
        table.read(ids), memory.read(ids)
        table.apply(ids, np.ones((100, 8), np.float32)), memory.apply(ids, np.ones((100, 8), np.float32))
    table.write_back.drain()
    db.error = Exception("IO error: No space left on device")
    with pytest.raises(SpillError, match="No space left on device") as raised:
        fill(table, 10_000, 10_000 + 2 * table.write_back.max_rows)  # more than the queue holds
    assert raised.value.full and tiers.condition.state == FULL
    assert table.write_back.rows > 0  # rows the writer could not write wait in the queue
    with pytest.raises(SpillError, match="No space left on device"):
        table.read(np.arange(100, dtype=np.int64))  # on disk: reading them needs room
    hot = np.sort(table.hot.ids[: table.hot.size])[:100]
    assert hot.shape[0] == 100
    np.testing.assert_array_equal(table.read(hot), memory.read(hot))  # rows in memory answer
    db.error = None  # room again: the next request that needs room has the writer try at once
    fill(table, 20_000, 20_000 + table.write_back.max_rows)
    assert tiers.condition.state == OK
    every = np.arange(2000, dtype=np.int64)
    np.testing.assert_array_equal(table.read(every), memory.read(every))


def test_a_checkpoint_and_an_eviction_pass_see_the_rows_still_queued(tiers):
    table, db = tiered(tiers, RowPolicy(max_rows=2500))
    memory = EmbeddingTable("t", 8, build_sparse_optimizer(ADAGRAD), INIT, ADAGRAD, policy=RowPolicy(max_rows=2500))
    for lo in range(0, 3000, 100):
        ids = np.arange(lo, lo + 100, dtype=np.int64)
        np.testing.assert_array_equal(table.read(ids), memory.read(ids))
    db.gated = True
    fill(table, 10_000, 10_000 + table.write_back.slice_rows)
    memory.read(np.arange(10_000, 10_000 + table.write_back.slice_rows, dtype=np.int64))
    assert table.write_back.rows > 0
    taken = []
    snapshot, raised = in_thread(lambda: taken.append(table.begin_snapshot(512, 1 << 20)))
    snapshot.join(0.3)
    assert snapshot.is_alive()  # the snapshot waits for the queued rows to reach the disk
    for _ in range(QUEUE_SLICES + 1):
        db.gate.release()
    snapshot.join(10)
    assert not raised and taken[0].size == memory.size
    chunks = [arrays for _, arrays in iter(taken[0].next_slice, None)]
    table.end_snapshot()
    ids = np.concatenate([c["ids"] for c in chunks])
    values = np.concatenate([c["values"] for c in chunks])[np.argsort(ids)]
    rows = memory.size
    assert np.unique(ids).shape[0] == ids.shape[0] == rows
    np.testing.assert_array_equal(values, memory.read(np.sort(ids)))
    assert memory.size == rows  # every id saved is one of memory's rows: all of them, each once
    db.gated = False
    assert table.evict() == memory.evict() > 0  # max_rows over every row, the queued ones included
    every = np.concatenate([np.arange(3000), np.arange(10_000, 10_000 + table.write_back.slice_rows)])
    np.testing.assert_array_equal(table.read(every), memory.read(every))
