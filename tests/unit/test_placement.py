import pytest

from paramserver.client.placement import Placer


def test_large_variable_is_split_along_axis_0_into_contiguous_row_ranges_on_distinct_shards():
    placer = Placer(3, split_bytes=1024)
    parts = placer.place("w", (10, 100), 4)
    assert sorted(p.shard for p in parts) == [0, 1, 2]
    assert parts[0].lo == 0 and parts[-1].hi == 10
    assert all(a.hi == b.lo for a, b in zip(parts, parts[1:]))
    assert all(not p.whole and p.name == f"w[{p.lo}:{p.hi}]" for p in parts)


def test_small_variables_go_whole_to_the_least_loaded_shard():
    placer = Placer(2, split_bytes=10**9)
    assert placer.place("a", (100,), 4)[0].shard == 0
    assert placer.place("b", (10,), 4)[0].shard == 1
    assert placer.place("c", (10,), 4)[0].shard == 1  # shard 1 holds 40 bytes, shard 0 holds 400
    assert placer.place("d", (1000,), 4)[0].shard == 1


def test_a_variable_with_fewer_rows_than_shards_uses_one_shard_per_row():
    parts = Placer(4, split_bytes=1).place("w", (2, 1000), 4)
    assert [(p.lo, p.hi) for p in parts] == [(0, 1), (1, 2)]


def test_placement_is_deterministic():
    shapes = [("a", (1024, 784)), ("b", (1024,)), ("c", (512, 1024)), ("d", (512,)), ("e", (10, 512))]
    runs = []
    for _ in range(2):
        placer = Placer(3)
        runs.append([placer.place(name, shape, 4) for name, shape in shapes])
    assert runs[0] == runs[1]


def test_zero_shards_is_refused():
    with pytest.raises(ValueError):
        Placer(0)
