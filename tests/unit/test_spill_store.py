"""The disk tier of a tiered table (server/spill_store.py): an extendible hash of pages in a mapped
file holds what a dict would, through splits, directory doublings, fingerprint collisions, deletes
and a full disk; and the memory tier (server/hot_rows.py) finds its rows through stale index entries
and rebuilds."""

import os

import numpy as np
import pytest

from paramserver.base.hashing import mix64
from paramserver.server import spill_store
from paramserver.server.hot_rows import HotRows, capacity_for, index_bytes, row_bytes
from paramserver.server.row_record import RowRecord
from paramserver.server.sparse_optimizers import build_sparse_optimizer
from paramserver.server.spill_store import SpillError, SpillStore

ADAM = build_sparse_optimizer({"name": "adam", "hyper": {"lr": 0.01, "per_row_step": True}})


def ids_with_hashes(hashes: np.ndarray) -> np.ndarray:
    """The ids whose mix64 is `hashes` (the murmur3 finalizer is a bijection; this is its inverse)."""
    x = hashes.astype(np.uint64)
    x ^= x >> np.uint64(33)
    x *= np.uint64(pow(0xC4CEB9FE1A85EC53, -1, 1 << 64))
    x ^= x >> np.uint64(33)
    x *= np.uint64(pow(0xFF51AFD7ED558CCD, -1, 1 << 64))
    x ^= x >> np.uint64(33)
    ids = x.view(np.int64)
    np.testing.assert_array_equal(mix64(ids), hashes.astype(np.uint64))
    return ids


def records_of(record: RowRecord, ids: np.ndarray, version: int) -> np.ndarray:
    """Records that tell which id and which write they come from."""
    records = record.empty(ids.shape[0])
    for name in record.names:
        field = records[name]
        stamp = (ids * 7 + version) % 100_003
        records[name] = stamp.reshape(-1, *[1] * (field.ndim - 1)) + np.zeros(field.shape, field.dtype)
    return records


class Model:
    """A SpillStore and the dict it must equal."""

    def __init__(self, tmp_path, record: RowRecord) -> None:
        path = tmp_path / "table"
        path.mkdir()
        self.store, self.record, self.rows = SpillStore(str(path), record), record, {}
        self.version = 0

    def put(self, ids: np.ndarray, places: np.ndarray | None = None) -> None:
        self.version += 1
        records = records_of(self.record, ids, self.version)
        self.store.put(ids, records, places)
        self.rows.update({int(i): r.tobytes() for i, r in zip(ids, records)})

    def check(self, probe: np.ndarray) -> None:
        found, records, places = self.store.get(probe)
        np.testing.assert_array_equal(found, [int(i) in self.rows for i in probe])
        assert [r.tobytes() for r in records] == [self.rows[int(i)] for i in probe[found]]
        np.testing.assert_array_equal(self.store.contains(probe), found)
        assert self.store.rows == len(self.rows)
        scanned = [(int(i), r.tobytes()) for chunk_ids, chunk in self.store.scan(97) for i, r in zip(chunk_ids, chunk)]
        assert len(scanned) == len(self.rows) and dict(scanned) == self.rows


@pytest.mark.parametrize("dim", [1, 16, 200])  # a few hundred rows a page down to the fewest
def test_the_store_holds_what_a_dict_would(tmp_path, dim):
    model = Model(tmp_path, RowRecord(dim, ADAM, tracks_use=True))
    rng = np.random.default_rng(dim)
    universe = rng.integers(-(1 << 62), 1 << 62, 6000)
    for step in range(40):
        ids = np.unique(universe[rng.integers(0, universe.shape[0], 400)])
        if step % 3 == 2:  # where get found them: written in place
            _, _, places = model.store.get(ids)
            known = model.store.contains(ids)
            hinted = np.full(ids.shape[0], -1)
            hinted[known] = places
            model.put(ids, hinted)
        else:
            model.put(ids)
        if step % 5 == 4:
            gone = np.unique(universe[rng.integers(0, universe.shape[0], 300)])
            model.store.delete(gone)
            for i in gone:
                model.rows.pop(int(i), None)
        model.check(np.unique(universe[rng.integers(0, universe.shape[0], 500)]))
    assert model.store._bits > 0 and model.store._used > 1  # pages split, the directory doubled
    model.check(universe)
    model.store.close()
    assert not (tmp_path / "table").exists()


def test_a_stale_place_is_looked_up_again(tmp_path):
    model = Model(tmp_path, RowRecord(4, ADAM, tracks_use=False))
    ids = np.arange(0, 5000, dtype=np.int64)
    model.put(ids[:100])
    _, _, places = model.store.get(ids[:100])
    model.put(ids[100:])  # pages split: rows moved
    model.store.delete(ids[:50:2])  # pages lost rows: the others moved up
    for i in ids[:50:2]:
        model.rows.pop(int(i))
    keep = np.ones(100, bool)
    keep[:50:2] = False
    model.put(ids[:100][keep], places[keep])
    model.check(ids)


def test_ids_alike_in_hash_prefix_and_fingerprint(tmp_path):
    model = Model(tmp_path, RowRecord(8, ADAM, tracks_use=False))
    rng = np.random.default_rng(1)
    low = rng.integers(0, 1 << 40, 700, dtype=np.uint64)
    # 700 ids whose hashes share their top 16 bits and their low byte: deep splits, every
    # fingerprint alike in a page
    hashes = np.unique((np.uint64(0xABCD) << np.uint64(48)) | (low << np.uint64(8)) | np.uint64(0x5A))
    close = ids_with_hashes(hashes)
    model.put(close[:400])
    model.put(rng.integers(-(1 << 62), 1 << 62, 3000))
    model.put(close[300:])
    assert model.store._bits > 16
    model.check(close)
    model.check(np.concatenate([close, ids_with_hashes(hashes + np.uint64(1 << 8))]))  # absent, same page


def test_too_many_ids_on_one_hash_prefix_are_refused_and_leave_the_store_as_it_was(tmp_path):
    model = Model(tmp_path, RowRecord(8, ADAM, tracks_use=False))
    model.put(np.arange(1000, dtype=np.int64))
    low = np.arange(200, dtype=np.uint64) << np.uint64(8)
    crafted = ids_with_hashes((np.uint64(0x123456789) << np.uint64(28)) | low)  # 36 bits alike
    with pytest.raises(SpillError, match="share a hash prefix"):
        model.store.put(crafted, records_of(model.record, crafted, 99))
    model.check(np.concatenate([crafted, np.arange(1000, dtype=np.int64)]))


def test_a_full_disk_fails_a_write_and_leaves_the_store_as_it_was(tmp_path, monkeypatch):
    model = Model(tmp_path, RowRecord(16, ADAM, tracks_use=False))
    model.put(np.arange(3000, dtype=np.int64))

    def full_disk(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(spill_store.os, "posix_fallocate", full_disk)
    model.store._room = model.store._used  # no spare page: a split must grow the file
    more = np.arange(3000, 9000, dtype=np.int64)
    with pytest.raises(SpillError, match="cannot write rows: .*No space left"):
        model.store.put(more, records_of(model.record, more, 5))
    model.check(np.arange(9000, dtype=np.int64))  # none of them: those placed were taken out again
    monkeypatch.undo()
    model.put(more)
    model.check(np.arange(9000, dtype=np.int64))
    assert model.store.disk_bytes() >= model.store._used * model.store.page_bytes
    assert os.path.getsize(model.store._file) >= model.store.disk_bytes()  # the mapped tail is a hole


def test_the_memory_tier_finds_its_rows_through_stale_entries_and_rebuilds():
    record = RowRecord(4, ADAM, tracks_use=False)
    hot = HotRows(record, 64)
    rng = np.random.default_rng(2)
    held: dict[int, int] = {}  # id -> row
    for step in range(300):
        candidates = np.unique(rng.integers(0, 150, 20))  # ids come back: they take their old entries
        rows, entries = hot.locate(candidates)
        np.testing.assert_array_equal(rows, [held.get(int(i), -1) for i in candidates])
        new = candidates[rows < 0][: hot.free]
        fields = {"values": np.full((new.shape[0], 4), step, np.float32)}
        added = hot.add(new, entries[rows < 0][: hot.free], fields, step)
        held.update(zip(new.tolist(), added.tolist()))
        assert np.all(hot.values[added] == step) and np.all(hot.fields["row_step"][added] == 0)
        if hot.free < 10:
            drop = np.array(sorted(held.values()))[rng.permutation(len(held))[:20]]
            hot.remove(drop)
            held = {i: r for i, r in held.items() if r not in set(drop.tolist())}
        assert hot.size == len(held) and sorted(hot.live().tolist()) == sorted(held.values())
    assert hot.rebuilds > 0
    hot.resize(max(hot.size, 40))
    np.testing.assert_array_equal(hot.ids[hot.find(np.array(sorted(held)))], sorted(held))


def test_the_memory_tier_fits_its_budget():
    for dim in (1, 8, 64):
        record = RowRecord(dim, ADAM, tracks_use=True)
        for budget in (1 << 16, 3 << 20, 100 << 20, 1 << 30):
            capacity = capacity_for(budget, record)
            assert capacity * row_bytes(record, capacity) + index_bytes(capacity) <= budget
            assert capacity * (row_bytes(record, capacity) + 64) > budget / 2  # not much of it unused
