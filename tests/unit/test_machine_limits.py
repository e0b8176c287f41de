"""Table limits derived from the machine's memory (base/options/machine.py), and refusals that say
which limit was reached and how to raise it (tables/limits.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError, ResourceExhaustedError
from paramserver.base.options.machine import SMALLEST_ROW_BYTES, MachineMemory, derived_limits
from paramserver.tables.limits import TableLimits, row_bytes
from paramserver.tables.table_store import TableStore

GiB = 1 << 30
ROWS = {"name": "sgd", "hyper": {"lr": 0.1}}


def machine(tmp_path: Path, mem_kb: int, cgroup: str, files: dict[str, str]) -> Path:
    """A directory standing for / : /proc/meminfo, /proc/self/cgroup and cgroup files."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/meminfo").write_text(f"MemTotal:       {mem_kb} kB\nMemFree:        1 kB\n")
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_smallest_row_is_what_a_table_counts_for_a_dim_1_row_without_state():
    assert SMALLEST_ROW_BYTES == row_bytes(1, 0, False, False)


def test_limits_are_three_quarters_of_the_memory_and_memory_binds_before_rows():
    rows, max_bytes = derived_limits(512 * 10**9)  # a 512 GB machine
    assert max_bytes == 384 * 10**9 and rows == max_bytes // 48
    # the target's share per PS (4 PS): 169M rows of 199 bytes, 34 GB, fit with room to spare
    assert 169_000_000 <= rows and 169_000_000 * 199 <= max_bytes
    assert derived_limits(24 * GiB) == ((18 * GiB) // 48, 18 * GiB)
    assert derived_limits(1) == (1, 1)  # never 0: a limit of 0 would mean "derive"


def test_physical_memory_without_a_cgroup_limit(tmp_path):
    root = machine(tmp_path, 64 * 1024 * 1024, "0::/\n", {"memory.max": "max\n"})
    memory = MachineMemory.read(root)
    assert memory == MachineMemory(64 * GiB, None)
    assert (memory.usable, memory.source) == (64 * GiB, "physical memory")


def test_a_cgroup_v2_limit_bounds_the_memory_and_the_tightest_ancestor_wins(tmp_path):
    files = {"memory.max": "max\n", "kubepods/memory.max": str(48 * GiB), "kubepods/pod1/memory.max": str(32 * GiB)}
    root = machine(tmp_path, 512 * 1024 * 1024, "0::/kubepods/pod1\n", files)
    memory = MachineMemory.read(root)
    assert (memory.usable, memory.source) == (32 * GiB, "the cgroup's memory limit")
    assert Options().for_machine(memory).max_table_memory_bytes == 24 * GiB


def test_a_cgroup_v1_limit_and_v1_s_no_limit(tmp_path):
    cgroup = "9:pids:/\n4:memory:/docker/abc\n0::/\n"
    limited = machine(
        tmp_path / "a", 16 * 1024 * 1024, cgroup, {"memory/docker/abc/memory.limit_in_bytes": str(8 * GiB)}
    )
    assert MachineMemory.read(limited).usable == 8 * GiB
    unlimited = machine(
        tmp_path / "b", 16 * 1024 * 1024, cgroup, {"memory/memory.limit_in_bytes": "9223372036854771712"}
    )
    assert MachineMemory.read(unlimited) == MachineMemory(16 * GiB, None)


def test_a_limit_given_wins_over_the_derived_one():
    memory = MachineMemory(100 * GiB)
    derived = Options().for_machine(memory)
    assert (derived.max_table_rows, derived.max_table_memory_bytes) == derived_limits(100 * GiB)
    given = Options(max_table_rows=1000, max_table_memory_bytes=GiB).for_machine(memory)
    assert (given.max_table_rows, given.max_table_memory_bytes) == (1000, GiB)
    half = Options(max_table_memory_bytes=GiB).for_machine(memory)
    assert (half.max_table_rows, half.max_table_memory_bytes) == (derived.max_table_rows, GiB)


def test_a_budget_over_the_derived_memory_limit_is_refused_when_the_ps_derives_it():
    options = Options(table_memory_budget=32 * GiB, spill_dir="/s")  # fine until the machine is known
    with pytest.raises(ConfigError, match="table_memory_budget.*max_table_memory_bytes"):
        options.for_machine(MachineMemory(16 * GiB))
    assert options.max_table_memory_bytes == 0 and options.for_machine(MachineMemory(64 * GiB))


def test_the_options_take_0_for_derived_and_refuse_less():
    assert (Options().max_table_rows, Options().max_table_memory_bytes) == (0, 0)
    for name in ("max_table_rows", "max_table_memory_bytes"):
        with pytest.raises(ConfigError, match=f"'{name}' must be 0 \\(derived from the machine's memory\\) or more"):
            Options.from_dict({name: -1})


def test_table_limits_given_0_derive_them_from_this_machine():
    rows, max_bytes = derived_limits(MachineMemory.read().usable)
    assert (TableLimits(0, 0).max_rows, TableLimits(0, 0).max_bytes) == (rows, max_bytes)
    assert (TableLimits(max_rows=0, max_bytes=GiB).max_rows, TableLimits(max_rows=5).max_rows) == (rows, 5)
    with pytest.raises(ConfigError, match="0 \\(derived\\) or more"):
        TableLimits(max_rows=-1)


def test_a_refusal_names_the_limit_its_value_and_how_to_raise_it():
    store = TableStore(0, limits=TableLimits(max_rows=2000))
    store.register("t", 4, ROWS, {"kind": "zeros"})
    store.lookup("t", np.arange(1900, dtype=np.int64))
    with pytest.raises(ResourceExhaustedError) as refused:
        store.lookup("t", np.arange(1800, 2200, dtype=np.int64))
    message = str(refused.value)
    assert "max_table_rows 2000" in message and "--max-table-rows" in message and "option max_table_rows" in message
    assert store.describe()["t"]["rows"] == 1900  # nothing created

    store = TableStore(0, limits=TableLimits(max_bytes=4 << 20))
    with pytest.raises(ResourceExhaustedError) as refused:
        store.register("big", 64, ROWS, {"kind": "zeros"}, capacity=1 << 16)
    message = str(refused.value)
    assert f"max_table_memory_bytes {4 << 20}" in message and "--max-table-memory" in message
    assert "option max_table_memory_bytes" in message and store.describe() == {}
