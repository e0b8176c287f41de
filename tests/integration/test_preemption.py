"""Preemption: SIGTERM or a first Ctrl-C on `paramserver run --checkpoint-dir` writes a checkpoint at the
workers' next step, then stops; a resumed run goes on from it. Bounded by --preempt-grace; a second
Ctrl-C stops at once. The closing JSON line comes every time."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from tests.conftest import ROOT

from paramserver.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.cluster

SMALL = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")
RESUME = str(ROOT / "tests" / "integration" / "scripts" / "train_resume.py")


def paramserver(*args: str) -> list[str]:
    return [sys.executable, "-m", "paramserver", *args]


def _start(procs, *args: str):
    return procs.start(paramserver("run", "--progress-every", "0.2", *args), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)


def _read_until(proc, pattern: str, seen: list[str], at_least: int = 0) -> None:
    """Read the run's lines until one matches `pattern` (with a number of at least `at_least` in group 1)."""
    for line in proc.stdout:
        seen.append(line)
        match = re.search(pattern, line)
        if match and (not at_least or int(match[1].replace(",", "")) >= at_least):
            return
    raise AssertionError("".join(seen))


STEPS = r"^\[run\] steps=([\d,]+)"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
def test_a_signal_writes_a_checkpoint_at_the_next_step_and_the_resumed_run_goes_on_from_it(procs, tmp_path, sig):
    ckpt = str(tmp_path / "ckpt")
    proc = _start(procs, "--checkpoint-dir", ckpt, RESUME, "--", "--steps", "1000000")
    seen: list[str] = []
    _read_until(proc, STEPS, seen, at_least=10)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    out = "".join(seen) + out
    assert proc.returncode == 130, out
    assert "preemption checkpoint written after step" in out, out
    written = re.search(r"preemption checkpoint written after step (\d+)", out)[1]
    assert CheckpointStore(ckpt).complete() == [f"ckpt-{int(written):09d}"], out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["checkpoints_written"] == 1
    (stopping,) = [line for line in out.splitlines() if line.startswith("[run] interrupted at steps=")]
    assert f"steps={summary['steps']:,} " in stopping  # the steps up to the checkpoint, all of them counted
    assert procs.leftovers() == []

    resumed = _start(procs, "--checkpoint-dir", ckpt, "--resume", RESUME, "--", "--steps", str(int(written) + 3))
    out, _ = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, out
    assert json.loads(out.strip().splitlines()[-1])["resumed_from"] == int(written)
    assert procs.leftovers() == []


def test_a_checkpoint_that_cannot_finish_within_the_grace_is_given_up_and_said(procs, tmp_path):
    proc = _start(procs, "--checkpoint-dir", str(tmp_path / "ckpt"), "--preempt-grace", "1", SMALL, "--",
                  "--steps", "0", "--step-sleep", "600")  # a step that outlasts any grace
    seen: list[str] = []
    _read_until(proc, STEPS, seen, at_least=1)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    out = "".join(seen) + out
    assert proc.returncode == 130, out
    assert "the preemption checkpoint did not finish within 1s of SIGTERM; exiting without it" in out
    assert time.monotonic() - started < 15, out
    assert json.loads(out.strip().splitlines()[-1]).get("checkpoints_written", 0) == 0
    assert procs.leftovers() == []


@pytest.mark.parametrize("group", [False, True], ids=["launcher", "process-group"])
def test_a_second_interrupt_stops_at_once_and_still_prints_the_closing_line(procs, tmp_path, group):
    proc = _start(procs, "--checkpoint-dir", str(tmp_path / "ckpt"), "--workers", "2", SMALL, "--",
                  "--steps", "0", "--step-sleep", "600")
    seen: list[str] = []
    _read_until(proc, STEPS, seen, at_least=1)

    def interrupt() -> None:
        if group:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        else:
            proc.send_signal(signal.SIGINT)

    interrupt()
    _read_until(proc, r"^\[run\] interrupt: a checkpoint at the workers' next step", seen)
    started = time.monotonic()
    interrupt()
    out, _ = proc.communicate(timeout=30)
    out = "".join(seen) + out
    assert proc.returncode == 130, out
    assert "interrupted again: killing every node now" in out
    assert time.monotonic() - started < 10, out
    assert "steps" in json.loads(out.strip().splitlines()[-1])
    assert procs.leftovers() == []
