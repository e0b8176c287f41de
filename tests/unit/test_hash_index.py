import sys

import numpy as np
import pytest

from paramserver.tables import reserved
from paramserver.tables.hash_index import HashIndex

pytestmark = pytest.mark.usefixtures("both_kernel_paths")


def test_insert_then_find_any_int64_ids_including_extremes():
    index = HashIndex(16)
    ids = np.array([0, -1, 2**63 - 1, -(2**63), 42, 7], np.int64)
    rows = index.insert(ids)
    np.testing.assert_array_equal(rows, np.arange(6))
    np.testing.assert_array_equal(index.find(ids), rows)
    np.testing.assert_array_equal(index.find(np.array([5, 43], np.int64)), [-1, -1])


def test_many_ids_grow_the_table_and_keep_every_mapping():
    rng = np.random.default_rng(0)
    ids = np.unique(rng.integers(-(2**62), 2**62, 200_000))
    index = HashIndex(1024)
    rows = np.concatenate([index.insert(chunk) for chunk in np.array_split(ids, 7)])
    assert index.size == ids.size and index.capacity >= 2 * ids.size
    np.testing.assert_array_equal(index.find(ids), rows)
    stored_ids, stored_rows = index.items()
    np.testing.assert_array_equal(stored_rows, np.arange(ids.size))
    np.testing.assert_array_equal(stored_ids, ids)


def test_colliding_ids_in_one_batch_all_find_a_slot():
    index = HashIndex(16)
    ids = np.arange(0, 8 * 4096, 4096, dtype=np.int64)  # same low bits
    index.insert(ids)
    np.testing.assert_array_equal(index.find(ids), np.arange(8))


@pytest.fixture
def small_shares(monkeypatch):
    """Growths move a few slots per call and fault in few ahead, and arrays are mapped from 64
    slots on, so small indexes go through many calls of every growth."""
    from paramserver.tables import hash_index

    monkeypatch.setattr(hash_index, "_SHARE_MIN", 8)
    monkeypatch.setattr(hash_index, "_AHEAD", 8)
    monkeypatch.setattr(hash_index, "_RESERVE_FROM", 64)


def test_an_index_growing_incrementally_finds_what_a_dict_does(small_shares):
    rng = np.random.default_rng(1)
    index, reference, growths = HashIndex(16), {}, 0
    pool = np.unique(rng.integers(-(2**63), 2**63 - 1, 20_000, dtype=np.int64))
    rng.shuffle(pool)
    stored = 0
    expected = np.empty(pool.size, np.int64)  # reference's rows of pool[:stored], in pool's order
    while stored < pool.size:
        batch = pool[stored : stored + int(rng.integers(1, 300))]
        was_growing = index.growing
        rows = index.insert(batch)
        growths += index.growing and not was_growing
        reference.update(zip(batch.tolist(), rows.tolist()))
        expected[stored : stored + batch.size] = [reference[i] for i in batch.tolist()]
        stored += batch.size
        # each stored id is where a find looks, even right at a moved stretch's end (find_still: a find
        # of every id would end a move at once)
        everything = pool[:stored]
        np.testing.assert_array_equal(index.find_still(everything), expected[:stored])
        probe = rng.choice(pool, 100)  # stored and maybe not
        np.testing.assert_array_equal(index.find(probe), [reference.get(i, -1) for i in probe.tolist()])
        assert index.size == len(reference)
    assert growths >= 6
    keys, rows = index.items()
    np.testing.assert_array_equal(rows, np.arange(pool.size))
    np.testing.assert_array_equal(keys, pool)


def test_ids_whose_probe_runs_into_the_moved_part_are_found_in_the_new_array(small_shares):
    from paramserver.tables import hash_index

    index = HashIndex(4096)
    first = np.arange(1, 1538, dtype=np.int64)
    index.insert(first[:-1])
    index.insert(first[-1:])  # past 3/8: a growth starts, moving a few slots a call
    assert index.growing
    ids = np.arange(10_000, 2_000_000, dtype=np.int64)
    homes = (hash_index.mix64(ids) & np.uint64(4095)).astype(np.int64)
    last = ids[homes == (index.growth.start - 1) % 4096][:3]  # homes just before the slot kept empty
    for id_ in last:
        index.insert(np.array([id_], np.int64))
    growth = index.growth
    assert growth is not None and growth.old[growth.start, 1] == 0
    assert np.isin(last, growth.new[:, 0]).any()  # a probe ran into the kept-empty slot: placed in the new array
    np.testing.assert_array_equal(index.find(last), np.arange(1537, 1540))
    np.testing.assert_array_equal(index.find(first), np.arange(1537))


def test_items_and_bytes_count_both_arrays_while_slots_move(small_shares):
    index = HashIndex(1024)
    ids = np.arange(1, 1001, dtype=np.int64) * 7919
    for chunk in np.array_split(ids, 50):
        index.insert(chunk)
        if index.growing and index.growth.moved:
            break
    assert index.growing and 0 < index.growth.moved < 1024
    keys, rows = index.items()
    np.testing.assert_array_equal(keys, ids[: index.size])
    np.testing.assert_array_equal(rows, np.arange(index.size))
    assert index.capacity * 16 // 2 < index.nbytes < index.capacity * 16
    while index.growing:
        index.find(ids[:1])  # a table only read finishes the move
    assert index.nbytes == index.capacity * 16
    np.testing.assert_array_equal(index.find(ids[: index.size]), np.arange(index.size))


def test_a_batch_larger_than_the_room_left_finishes_a_growth_at_once(small_shares):
    index = HashIndex(64)
    index.insert(np.arange(30, dtype=np.int64))  # past 3/8: a growth starts
    assert index.growing
    big = np.arange(100, 5100, dtype=np.int64)
    rows = index.insert(big)
    assert 2 * index.size <= index.capacity
    np.testing.assert_array_equal(index.find(big), rows)
    np.testing.assert_array_equal(index.find(np.arange(30, dtype=np.int64)), np.arange(30))


def test_an_index_holding_a_known_batch_takes_it_without_growing():
    for n in (1, 1000, 3000, 100_000):
        index = HashIndex.holding(n)
        index.insert(np.arange(n, dtype=np.int64))
        assert not index.growing and index.capacity <= max(16, 6 * n)  # a power of two under twice n / (3/8)


def test_removed_ids_are_forgotten_and_the_others_keep_their_rows():
    rng = np.random.default_rng(3)
    ids = np.unique(rng.integers(-(2**63), 2**63 - 1, 5_000, dtype=np.int64))
    index = HashIndex.holding(ids.size)
    rows = index.insert(ids)
    reference = dict(zip(ids.tolist(), rows.tolist()))
    for _ in range(20):  # removals interleaved with insertions: probe runs broken and refilled
        gone = rng.choice(np.array(list(reference), np.int64), 200, replace=False)
        index.remove(np.concatenate([gone, np.array([12345], np.int64)]))  # an absent id is skipped
        for key in gone.tolist():
            del reference[key]
        back = gone[:100]
        index.place(back, np.arange(100, dtype=np.int64) + 10_000)
        reference.update(zip(back.tolist(), range(10_000, 10_100)))
        keys = np.array(list(reference), np.int64)
        np.testing.assert_array_equal(index.find(keys), [reference[k] for k in keys.tolist()])
        np.testing.assert_array_equal(index.find(gone[100:]), -1)
        assert index.size == len(reference)


def test_colliding_ids_removed_from_the_middle_of_a_probe_run_leave_the_rest_findable():
    index = HashIndex(16)
    ids = np.arange(0, 8 * 4096, 4096, dtype=np.int64)  # one home: one run of 8 slots
    index.insert(ids)
    index.remove(ids[[1, 4]])
    kept = ids[[0, 2, 3, 5, 6, 7]]
    np.testing.assert_array_equal(index.find(kept), [0, 2, 3, 5, 6, 7])
    np.testing.assert_array_equal(index.find(ids[[1, 4]]), [-1, -1])
    assert index.size == 6


def resident_bytes(array: np.ndarray) -> int:
    """Bytes of `array`'s pages in memory (mincore), its start rounded down to a page."""
    import ctypes
    import mmap

    start = array.ctypes.data // mmap.PAGESIZE * mmap.PAGESIZE
    length = array.ctypes.data + array.nbytes - start
    pages = -(-length // mmap.PAGESIZE)
    flags = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), flags) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(flag & 1 for flag in flags) * mmap.PAGESIZE


def huge_page_kib(address: int) -> dict[str, int]:
    """Rss and AnonHugePages (KiB) of the mapping holding `address` (with any the kernel merged
    with it), from /proc/self/smaps."""
    figures, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(part, 16) for part in head.split("-"))
                inside = lo <= address < hi
            elif inside and head in ("Rss:", "AnonHugePages:"):
                figures[head[:-1]] = int(line.split()[1])
    return figures


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore, /proc/self/smaps")
def test_a_growth_hands_the_old_slots_back_as_it_moves_them_without_splitting_huge_pages():
    index = HashIndex(1 << 21)  # 32 MiB of slots, faulted in
    old = index.slots
    ids = np.arange(1, (1 << 21) * 3 // 8 + 2, dtype=np.int64)
    index.insert(ids)  # past 3/8: a growth starts
    huge = huge_page_kib(old.ctypes.data).get("AnonHugePages", 0) > 0  # transparent huge pages at work here
    fresh = 1 << 40
    while index.growing and index.growth.moved < old.shape[0] // 2:
        index.insert(np.arange(fresh, fresh + 20_000, dtype=np.int64))
        fresh += 20_000
    assert index.growing
    unmoved = (old.shape[0] - index.growth.moved) * 16
    assert resident_bytes(old) <= unmoved + 2 * reserved.HUGE_PAGE, (resident_bytes(old), unmoved)
    if huge:  # every page of the two arrays still whole
        figures = huge_page_kib(old.ctypes.data)
        assert figures["AnonHugePages"] == figures["Rss"], figures
    np.testing.assert_array_equal(index.find(ids[:1000]), np.arange(1000))
