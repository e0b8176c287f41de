"""The limits a PS derives from its machine's memory, read once when the PS starts.

`max_table_rows` and `max_table_memory_bytes` default to 0: derived. A PS resolves them once, at
start (`Options.for_machine`): `max_table_memory_bytes` becomes `TABLE_MEMORY_SHARE` of the memory
this process may use (the cgroup's memory limit when one is set, as in a container with a memory
limit; else the machine's physical memory), and `max_table_rows` that many bytes over the smallest
row a table can have (`SMALLEST_ROW_BYTES`), so that memory is the binding limit. A value given
(flag, cluster file, PARAMSERVER_OPTIONS) is kept as it is. The rest of the memory is for what the
tables' bytes do not count: the interpreter, gRPC and stream buffers, rows copied aside while a
checkpoint is written, a tiered table's RocksDB overhead.

Several PS processes on one machine without a memory limit each would each take the share of the
whole machine: give each a container limit, or `--max-table-memory` of its part.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paramserver.base.options.options import Options

log = logging.getLogger(__name__)

TABLE_MEMORY_SHARE = 0.75  # of the memory this process may use
TABLE_MEMORY_SHARE_WORDS = "3/4"
# a dim-1 row without optimizer state: 4 B value + 8 B id + 4 B change epoch + 32 B of hash index
# (tables/limits.py `row_bytes(1, 0, False, False)`; tests/unit/test_machine_limits.py checks it)
SMALLEST_ROW_BYTES = 48
DERIVED = 0  # the option's value that asks for the derived limit


@dataclass(frozen=True)
class MachineMemory:
    """Bytes of memory this process may use: the machine's `physical` memory, bounded by
    `cgroup_limit` (None: no limit set, or one above the physical memory)."""

    physical: int
    cgroup_limit: int | None = None

    @property
    def usable(self) -> int:
        if self.cgroup_limit is None:
            return self.physical
        return min(self.physical, self.cgroup_limit)

    @property
    def source(self) -> str:
        """Where `usable` comes from, in words."""
        if self.cgroup_limit is not None and self.cgroup_limit < self.physical:
            return "the cgroup's memory limit"
        return "physical memory"

    @classmethod
    def read(cls, root: Path = Path("/")) -> MachineMemory:
        """The memory of this machine and this process's cgroup (v2 or v1); `root`: where /proc and
        /sys are (tests give a directory of their own)."""
        physical = _physical(root)
        limit = _cgroup_limit(root)
        return cls(physical, limit if limit is not None and limit < physical else None)


def derived_limits(memory: int) -> tuple[int, int]:
    """(max_table_rows, max_table_memory_bytes) a PS derives from `memory` bytes it may use."""
    max_bytes = max(1, int(memory * TABLE_MEMORY_SHARE))
    return max(1, max_bytes // SMALLEST_ROW_BYTES), max_bytes


def for_machine(options: Options, memory: MachineMemory | None = None) -> Options:
    """`options` with the derived limits (those left at 0) filled from `memory` (read now when
    None). Call once, when a PS starts; raises ConfigError when an option given does not fit them
    (a table_memory_budget over the derived max_table_memory_bytes), naming both."""
    derive_rows = options.max_table_rows == DERIVED
    derive_bytes = options.max_table_memory_bytes == DERIVED
    if not (derive_rows or derive_bytes):
        return options
    memory = memory or MachineMemory.read()
    rows, max_bytes = derived_limits(memory.usable)
    resolved = replace(
        options,
        max_table_rows=rows if derive_rows else options.max_table_rows,
        max_table_memory_bytes=max_bytes if derive_bytes else options.max_table_memory_bytes,
    )
    log.info(
        "table limits from %s (%.1f GiB): max_table_rows %d%s, max_table_memory_bytes %d (%.1f GiB)%s",
        memory.source,
        memory.usable / 2**30,
        resolved.max_table_rows,
        " (derived)" if derive_rows else " (given)",
        resolved.max_table_memory_bytes,
        resolved.max_table_memory_bytes / 2**30,
        f" (derived: {TABLE_MEMORY_SHARE_WORDS} of it)" if derive_bytes else " (given)",
    )
    return resolved


def _physical(root: Path) -> int:
    """MemTotal of /proc/meminfo; the page count times the page size where it cannot be read."""
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cgroup_limit(root: Path) -> int | None:
    """The tightest memory limit over this process's cgroup and its parents (v2: memory.max; v1:
    memory.limit_in_bytes); None where none is set or none can be read."""
    limits = []
    for directory, name in _cgroup_files(root):
        try:
            text = (directory / name).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # v2 writes "max" for none; v1 a number near 2^63
            limits.append(int(text))
    return min(limits) if limits else None


def _cgroup_files(root: Path) -> list[tuple[Path, str]]:
    """Where this process's memory limits may be: its own cgroup's directory and its parents, under
    the v2 (unified) mount and the v1 memory controller's; a container's own cgroup is the mount's root."""
    mount = root / "sys/fs/cgroup"
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    found = [(mount, "memory.max"), (mount / "memory", "memory.limit_in_bytes")]
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            base, name = mount, "memory.max"
        elif "memory" in controllers.split(","):
            base, name = mount / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [part for part in path.split("/") if part and part != ".."]
        found += [(base.joinpath(*parts[:depth]), name) for depth in range(1, len(parts) + 1)]
    return found
