"""Busy processes for the benches' contended mode (`--contend N`): N Python loops that each keep
one core busy while a case runs, as other jobs on a shared machine would. Started before the
case, stopped by PID after it (also when it fails).

    with busy_processes(2):
        ...  # the case, measured under two busy processes
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

_SPIN = "while True:\n    pass\n"
_STOP_GRACE_S = 5.0


@contextmanager
def busy_processes(count: int) -> Iterator[list[int]]:
    """Run `count` busy processes (one spinning Python loop each) for the duration; their PIDs."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL))
        time.sleep(0.5 if count else 0)  # let them reach their loops
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(_STOP_GRACE_S)


def load() -> list[float]:
    """The machine's load averages (1, 5, 15 minutes), rounded: said next to every figure."""
    return [round(x, 2) for x in os.getloadavg()]
