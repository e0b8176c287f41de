"""Arrays in reserved address space: zeros until written, pages handed back, and None where refused."""

import sys

import numpy as np
import pytest

from paramserver.tables import reserved

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux address-space behaviour")


def test_a_reservation_far_larger_than_memory_reads_as_zeros_and_takes_writes():
    array = reserved.reserve(1 << 30, (16,), np.float32)  # 64 GiB of address space
    assert array is not None and array.shape == (1 << 30, 16) and reserved.is_reserved(array[:10])
    array[[0, 12345, (1 << 30) - 1]] = 1.5
    assert array[:20000].sum() == 48 and array[-1].sum() == 24
    assert not reserved.is_reserved(np.zeros(4))


@pytest.mark.parametrize(
    "make",
    [lambda: reserved.reserve(5000, (3,), np.int64), lambda: np.zeros((5000, 3), np.int64)],
    ids=["mapped", "plain"],
)
def test_release_zeroes_just_its_rows_and_populate_changes_nothing(make):
    array = make()
    array[:] = np.arange(15000).reshape(5000, 3) + 1
    before = array.copy()
    reserved.populate(array, 0, 5000)
    np.testing.assert_array_equal(array, before)
    for lo, hi in ((7, 9), (10, 4000), (4500, 5000)):  # within a page, across pages, to the end
        reserved.release(array, lo, hi)
        before[lo:hi] = 0
        np.testing.assert_array_equal(array, before)


def vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def test_under_an_address_space_limit_tables_fall_back_to_ordinary_arrays():
    resource = pytest.importorskip("resource")
    from paramserver.tables.embedding_table import EmbeddingTable
    from paramserver.tables.sparse_optimizers import build_sparse_optimizer

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY and hard < vm_size() + (2 << 30):
        pytest.skip("the address-space limit is already tight")
    spec = {"name": "adagrad", "hyper": {"lr": 0.1, "initial_accumulator_value": 0.5}}
    resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (1 << 30), hard))
    try:
        assert reserved.reserve(1 << 30, (16,), np.float32) is None
        table = EmbeddingTable("t", 16, build_sparse_optimizer(spec), {"kind": "zeros"}, spec, capacity=200_000)
        ids = np.arange(300_000, dtype=np.int64)  # past its capacity: grown by copying
        table.read(ids)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert not table.in_reserved_space and table.capacity >= 300_000 and table.values.shape[0] == table.capacity
    assert (table.state["sum"][:300_000] == 0.5).all() and (table.read(ids) == 0).all()


@pytest.mark.parametrize("page", [reserved._PAGE, reserved.HUGE_PAGE], ids=["4KiB", "2MiB"])
def test_hand_back_clears_only_whole_pages_inside_the_rows(page):
    rows_per_page = page // 8
    array = reserved.reserve(4 * rows_per_page, (), np.int64, huge=page == reserved.HUGE_PAGE)
    array[:] = 7
    base = array.ctypes.data % page // 8  # rows before the first page boundary (a mapping need not start at one)
    lo, hi = base + rows_per_page // 2, base + 3 * rows_per_page - 1  # half a page, one whole, most of one
    reserved.hand_back(array, lo, hi, page)
    zero = np.zeros(array.shape[0], bool)
    zero[base + rows_per_page : base + 2 * rows_per_page] = True
    assert (array[zero] == 0).all() and (array[~zero] == 7).all()
    plain = np.full(4 * rows_per_page, 7, np.int64)
    reserved.hand_back(plain, 0, plain.shape[0], page)  # not from `reserve`: left alone
    assert (plain == 7).all()
