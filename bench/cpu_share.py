"""How many cores each process of a case used while it trained: the benches' process-level profile.

    with CpuShare(exclude=busy_pids) as share:
        ...  # the case: every process it starts is a child (or grandchild) of this one
    share.cores()  # {"ps": [0.21, 0.19], "worker": [0.77, 0.76], ...}

A sampler thread reads the CPU time (user + system) of every descendant of this process four
times a second. A process's cores are its CPU seconds over the middle of its life (from 30% to
80% of the time it was seen), which leaves out the imports at its start and the evaluation at its
end; only processes alive at the middle of the case count (not a check that ran before it). Roles
come from the command line: a `paramserver node` without `--role` is a worker, `--role R` (our PS,
TensorFlow's processes) is R, the rest is named by its program. The busy processes of `--contend`
are left out.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict

import psutil

_EVERY_S = 0.25
_WINDOW = (0.3, 0.8)


def role_of(cmdline: list[str]) -> str:
    """A process's role, from its command line."""
    if "--role" in cmdline[:-1]:  # our PS, and TensorFlow's processes (chief, worker, ps)
        return cmdline[cmdline.index("--role") + 1]
    line = " ".join(cmdline)
    if " node " in f" {line} ":
        return "worker"
    if "multiprocessing" in line:
        return "spawned"
    for arg in cmdline[1:]:
        if not arg.startswith("-"):
            return os.path.basename(arg)
    return os.path.basename(cmdline[0]) if cmdline else "?"


class CpuShare:
    """Samples the CPU time of this process's descendants while the `with` block runs.
    Not thread-safe: one block at a time; `cores()` after the block."""

    def __init__(self, exclude: list[int] | tuple[int, ...] = ()) -> None:
        self._exclude = set(exclude)
        self._seen: dict[int, list[tuple[float, float]]] = defaultdict(list)
        self._roles: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="cpu-share-sampler", daemon=True)

    def __enter__(self) -> CpuShare:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(_EVERY_S):
            for child in me.children(recursive=True):
                if child.pid in self._exclude:
                    continue
                try:
                    times = child.cpu_times()
                    # read each time: a child seen between its fork and its exec has its parent's command
                    self._roles[child.pid] = role_of(child.cmdline())
                except psutil.Error:  # it ended between the listing and the read
                    continue
                self._seen[child.pid].append((time.monotonic(), times.user + times.system))

    def cores(self) -> dict[str, list[float]]:
        """Cores used per role (one entry per process, busiest first), over each one's middle window."""
        by_role: dict[str, list[float]] = defaultdict(list)
        seen = [t for points in self._seen.values() for t, _ in points]
        middle = (min(seen) + max(seen)) / 2 if seen else 0.0
        for pid, points in self._seen.items():
            if len(points) < 8 or not points[0][0] <= middle <= points[-1][0]:
                continue  # a helper that ended before the case's middle (an import check), or began after it
            first, last = points[int(len(points) * _WINDOW[0])], points[int(len(points) * _WINDOW[1])]
            cores = (last[1] - first[1]) / (last[0] - first[0]) if last[0] > first[0] else 0.0
            if cores >= 0.02:  # an idle helper (multiprocessing's resource tracker, say) is no part of it
                by_role[self._roles[pid]].append(round(cores, 2))
        return {role: sorted(values, reverse=True) for role, values in sorted(by_role.items())}
