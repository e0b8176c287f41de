import numpy as np
import pytest

from paramserver.server.hash_index import HashIndex

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
