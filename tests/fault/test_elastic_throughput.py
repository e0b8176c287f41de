"""Throughput follows the worker count of an elastic run (docs/elastic.md), with real processes.

One `paramserver run --ps 1 --workers 1 --max-workers 3` (async) of
tests/integration/scripts/elastic_paced.py, whose steps sleep a fixed time over data the coordinator
hands out, so that the worker count, not the machine's two cores, sets the speed. The real
`paramserver scale <launcher pid> N` drives it from 1 worker to 3, then back to 1. Each phase's
examples/s come from the workers' own step lines, over a window that starts once the phase's change
is complete (every new worker trained a step, every worker asked to leave exited). With a perfect
machine the phases train 1x, 3x and 1x; the bounds leave room for a loaded one and still fail when a
join or a leave changed nothing.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import psutil
import pytest
from tests.fault.launcher_run import LauncherRun
from tests.wait import wait_until

pytestmark = pytest.mark.fault  # one run of 1-3 workers, about 40 s

SCRIPT = "tests/integration/scripts/elastic_paced.py"
PACE_S = 0.05
BATCH = 32
WINDOW_S = 5.0  # each phase's measured part: about 80 steps of one worker
WARMUP_STEPS = 10  # the chief's first steps (registration, first replies) count in no phase
JOIN_WAIT_S = 60.0  # two workers importing torch on a loaded two-core machine
STEP = re.compile(r"^\[worker(\d+)\] STEP (\d+) (\d+) ([\d.]+)$")


def steps(run: LauncherRun) -> list[tuple[int, int, float]]:
    """Every step printed so far: (worker, examples, unix time at its end)."""
    found = []
    for line in list(run.lines):
        match = STEP.match(line.strip())
        if match:
            assert match[1] == match[2], line
            found.append((int(match[2]), int(match[3]), float(match[4])))
    return found


def first_step(run: LauncherRun, worker: int, after: float = 0.0, nth: int = 0) -> float:
    """When `worker`'s `nth` step that ended after `after` ended (waits for it)."""

    def ended() -> float | None:
        times = [t for w, _, t in steps(run) if w == worker and t > after]
        return times[nth] if len(times) > nth else None

    return wait_until(ended, f"step {nth} of worker {worker}:\n{run.output()}", timeout=JOIN_WAIT_S)


def measure(run: LauncherRun, start: float) -> tuple[float, dict[int, int]]:
    """examples/s of the steps that end in the WINDOW_S seconds from `start`, and each worker's examples."""
    end = start + WINDOW_S
    time.sleep(max(0.0, end - time.time()) + 0.5)  # the last lines of the window arrive
    by_worker: dict[int, int] = {}
    for worker, examples, t in steps(run):
        if start < t <= end:
            by_worker[worker] = by_worker.get(worker, 0) + examples
    return sum(by_worker.values()) / WINDOW_S, by_worker


def scale(procs, run: LauncherRun, workers: int) -> None:
    """`paramserver scale <launcher pid> N`, the real command: other runs may be on this machine."""
    proc = procs.start(
        [sys.executable, "-m", "paramserver", "scale", str(run.proc.pid), str(workers)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and f"for {workers} workers" in out, out


def stop_by_pid(run: LauncherRun) -> None:
    """Kill the launcher and every node it started, each by its PID (nothing when the run ended)."""
    if run.proc.poll() is not None:
        return
    try:
        nodes = psutil.Process(run.proc.pid).children(recursive=True)
    except psutil.Error:
        nodes = []
    run.proc.kill()
    run.proc.wait(30)
    for node in nodes:
        try:
            node.kill()
        except psutil.Error:
            pass  # gone already: a node ends with its launcher


def test_examples_per_second_rise_with_joins_and_fall_with_leaves(procs, tmp_path):
    stop = tmp_path / "stop"
    flags = ["--mode", "async", "--ps", "1", "--workers", "1", "--max-workers", "3"]
    args = ["--pace", str(PACE_S), "--batch", str(BATCH), "--stop", str(stop)]
    run = LauncherRun(procs, flags, SCRIPT, args)
    try:
        one, one_by_worker = measure(run, first_step(run, 0, nth=WARMUP_STEPS))

        asked_up = time.time()
        scale(procs, run, 3)
        run.wait_for("scaling to 3 workers: started [1, 2], asked to leave []", timeout=30)
        joined = max(first_step(run, worker, after=asked_up) for worker in (1, 2))
        three, three_by_worker = measure(run, joined)

        asked_down = time.time()
        scale(procs, run, 1)
        at = run.wait_for("scaling to 1 workers: started [], asked to leave [2, 1]", timeout=30)
        for worker in (1, 2):
            run.wait_for(f"worker{worker} left the run", after=at, timeout=30)
        left = time.time()
        last, last_by_worker = measure(run, left)

        stop.write_text("")
        summary = run.finish(timeout=60)  # asserts that it exited 0
    finally:
        stop_by_pid(run)
        stop.unlink(missing_ok=True)

    figures = (
        f"examples/s: 1 worker {one:.0f} {one_by_worker}, 3 workers {three:.0f} {three_by_worker}, "
        f"1 worker again {last:.0f} {last_by_worker} (windows of {WINDOW_S:g} s; "
        f"one worker's bound {BATCH / PACE_S:.0f}); joins took {joined - asked_up:.1f} s, "
        f"leaves {left - asked_down:.1f} s"
    )
    print(figures)
    assert summary["max_workers"] == 3, summary
    assert set(three_by_worker) == {0, 1, 2}, figures
    assert set(last_by_worker) == {0}, figures  # the leavers trained nothing after they left
    assert three >= 2.0 * one, figures
    assert last <= 0.6 * three, figures
    assert procs.leftovers() == []
