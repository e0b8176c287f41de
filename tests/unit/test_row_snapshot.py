"""A checkpoint's view of a table while training goes on: the rows as they were when it began,
whatever changes meanwhile, with the rows kept aside bounded (changes wait for the writer)."""

import threading

import numpy as np
import pytest
from tests.wait import finished

from paramserver.tables import table_store as table_store_module
from paramserver.tables.table_store import TableStore

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}


def store_with_rows(rows=5000, dim=4, policy=None):
    tables = TableStore(0)
    tables.register("t", dim, ADAGRAD, {"kind": "normal", "std": 0.1}, policy=policy)
    tables.lookup("t", np.arange(rows, dtype=np.int64) * 3)
    return tables


def rows_now(tables, name="t"):
    table = tables.table(name)
    return {key: table.array(key)[: table.size].copy() for key in table.layout()}


def push(tables, ids, value=1.0):
    tables.apply_rows([[tables.check_push("t", ids, np.full((ids.shape[0], 4), value, np.float32))]])


def drain(tables, name="t"):
    """Every slice of the snapshot, put together."""
    out = {}
    while (taken := tables.next_slice(name)) is not None:
        lo, arrays = taken
        for key, array in arrays.items():
            out.setdefault(key, []).append((lo, array))
    return {key: np.concatenate([a for _, a in sorted(parts, key=lambda p: p[0])]) for key, parts in out.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_snapshot_holds_the_rows_as_they_were_while_updates_and_new_rows_come_in(monkeypatch, seed):
    monkeypatch.setattr(table_store_module, "SNAPSHOT_SLICE_BYTES", 4000)  # many slices
    rng = np.random.default_rng(seed)
    tables = store_with_rows()
    push(tables, np.arange(100, dtype=np.int64) * 3)
    before = rows_now(tables)
    (meta, snapshot), = tables.begin_snapshot().values()
    assert meta["steps"] == 1 and snapshot.size == 5000
    saved = {}
    while True:  # a slice, then some training, in a random order
        for _ in range(rng.integers(0, 3)):
            ids = np.unique(rng.integers(0, 7000, 300)) * 3  # old rows and new ones
            tables.lookup("t", ids)
            push(tables, ids, float(rng.normal()))
        taken = tables.next_slice("t")
        if taken is None:
            break
        lo, arrays = taken
        for key, array in arrays.items():
            saved.setdefault(key, []).append(array)
    tables.end_snapshot()
    for key in before:
        np.testing.assert_array_equal(np.concatenate(saved[key]), before[key], err_msg=f"{key}, seed {seed}")
    assert tables.table("t").size > 5000  # the new rows were created meanwhile, outside the snapshot
    assert not np.array_equal(rows_now(tables)["values"][:5000], before["values"])


def test_eviction_waits_for_the_snapshot_to_end():
    tables = store_with_rows(200, policy={"ttl_steps": 1, "evict_every": 1})
    tables.begin_snapshot()
    push(tables, np.arange(3, dtype=np.int64) * 3)
    push(tables, np.arange(3, dtype=np.int64) * 3)  # every other row is stale now, but a snapshot is open
    assert tables.table("t").size == 200
    assert drain(tables)["ids"].shape[0] == 200
    tables.end_snapshot()
    tables.lookup("t", np.arange(3, dtype=np.int64) * 3)  # seen now: they stay
    push(tables, np.arange(3, dtype=np.int64) * 3)
    assert tables.table("t").size == 3


def test_changes_wait_while_the_rows_kept_aside_pass_their_budget_and_go_on_when_the_writer_moves(monkeypatch):
    monkeypatch.setattr(table_store_module, "SNAPSHOT_MIN_BUDGET", 1000)
    monkeypatch.setattr(table_store_module, "SNAPSHOT_SLICE_BYTES", 50_000)
    tables = store_with_rows()
    _, snapshot = tables.begin_snapshot()["t"]
    push(tables, np.arange(5000, dtype=np.int64)[-1000:] * 3)  # rows far ahead of the writer: kept aside
    assert snapshot.over_budget
    waiter = threading.Thread(target=push, args=(tables, np.arange(10, dtype=np.int64) * 3))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # held: memory stays bounded
    drain(tables)  # the writer passes the rows kept aside
    finished(waiter, "the held push to go on once the writer passed the rows kept aside")
    assert snapshot.kept_bytes == 0 and snapshot.peak_kept_bytes > 1000
    tables.end_snapshot()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_delta_holds_the_rows_changed_since_its_parent_as_they_were_while_updates_come_in(monkeypatch, seed):
    monkeypatch.setattr(table_store_module, "SNAPSHOT_SLICE_BYTES", 4000)  # many slices
    rng = np.random.default_rng(seed)
    tables = store_with_rows(policy={"ttl_steps": 1000})  # a lookup changes a row (its use counts)
    tables.begin_snapshot()  # the parent
    tables.end_snapshot()
    parent = tables.snapshot_epoch
    ids = np.arange(5000, dtype=np.int64) * 3
    changed = np.sort(rng.choice(ids, 300, replace=False))
    push(tables, changed)
    tables.lookup("t", changed[:20])
    expected = rows_now(tables)
    (_, snapshot), = tables.begin_snapshot(since=parent).values()
    assert snapshot.rows == 300
    first = tables.next_slice("t")
    for _ in range(5):  # changes while it streams, to rows in the delta and to others, and new rows
        push(tables, np.sort(rng.choice(ids, 200, replace=False)), value=rng.normal())
        tables.lookup("t", np.arange(5) * 3 + 1 + 100000 * _)
    got = drain(tables)
    tables.end_snapshot()
    got = {key: np.concatenate([first[1][key], got.get(key, first[1][key][:0])]) for key in first[1]}
    picked = np.isin(expected["ids"], changed)
    for key in expected:
        assert got[key].tobytes() == expected[key][picked].tobytes(), key
