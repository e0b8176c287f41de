"""`paramserver run` and `paramserver demo`: real processes, prefixed logs, exit codes, no leftovers."""

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # whole clusters of processes: a minute for this file

SMALL = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")
CHILD_MEMORY = str(ROOT / "tests" / "integration" / "scripts" / "child_memory.py")


def paramserver(*args: str) -> list[str]:
    return [sys.executable, "-m", "paramserver", *args]


def finish(proc, timeout=240):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def test_run_trains_with_prefixed_logs_progress_and_a_summary(procs):
    proc = procs.start(paramserver("run", "--ps", "2", "--workers", "2", "--progress-every", "0.5", SMALL,
                                   "--", "--steps", "60"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code, out = finish(proc)
    assert code == 0, out
    assert "[worker0] worker 0/2 done" in out and "[worker1] worker 1/2 done" in out
    assert "[ps0]" in out and "[ps1]" in out
    assert "[run] steps=" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 120 and summary["examples"] == 960
    assert summary["worker0_steps"] == 60 and summary["workers"] == 2 and summary["ps"] == 2
    assert 0 < summary["peak_rss_mb"]["ps"] < 250
    assert procs.leftovers() == []


def test_a_workers_child_processes_count_toward_its_peak_memory(procs):
    proc = procs.start(paramserver("run", "--ps", "1", "--workers", "1", "--progress-every", "0", CHILD_MEMORY,
                                   "--", "--mb", "300"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code, out = finish(proc, timeout=120)
    assert code == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["peak_rss_mb"]["worker"] > 300  # the child's 300 MB on top of the worker's own
    assert summary["peak_rss_mb"]["ps"] < 250
    assert procs.leftovers() == []


def test_a_failing_worker_fails_the_run_and_stops_every_node(procs):
    proc = procs.start(paramserver("run", "--ps", "1", "--workers", "2", SMALL, "--", "--steps", "0",
                                   "--fail-worker", "1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code, out = finish(proc, timeout=120)
    assert code != 0
    assert "worker1 failed" in out and "fails on purpose" in out
    assert procs.leftovers() == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_launcher_stops_every_node(procs, sig):
    proc = procs.start(paramserver("run", "--ps", "1", "--workers", "2", "--progress-every", "0.2", SMALL, "--",
                                   "--steps", "0"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    for line in proc.stdout:  # wait until training is under way
        if line.startswith("[run] steps=") or time.monotonic() > deadline:
            break
    proc.send_signal(sig)
    code, out = finish(proc, timeout=60)
    assert code == 130
    assert procs.leftovers() == []


def test_a_launcher_killed_outright_takes_its_nodes_with_it(procs):
    proc = procs.start(paramserver("run", "--ps", "1", "--workers", "1", "--progress-every", "0.2", SMALL, "--",
                                   "--steps", "0"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("[run] steps="):
            break
    assert len(procs.leftovers()) >= 2  # the launcher's nodes are running
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while procs.leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert procs.leftovers() == []


def test_demo_reaches_95_percent_on_held_out_digits(procs):
    proc = procs.start(paramserver("demo", "--progress-every", "0"), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    code, out = finish(proc, timeout=400)
    assert code == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["test_accuracy"] >= 0.95
    assert result["ps"] == 2 and result["workers"] == 2
    assert result["steps"] > 0 and result["examples_per_s"] > 0 and result["wall_s"] > 0
    assert procs.leftovers() == []


def test_script_errors_are_clear(procs):
    proc = procs.start(paramserver("run", "--ps", "1", "--workers", "1", str(ROOT / "no_such_script.py")),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code, out = finish(proc, timeout=120)
    assert code != 0 and "no_such_script.py does not exist" in out
    assert procs.leftovers() == []


def test_run_in_sync_mode_with_a_backup_worker(procs):
    proc = procs.start(paramserver("run", "--ps", "2", "--workers", "3", "--mode", "sync", "--backup-workers", "1",
                                   "--progress-every", "0.5", SMALL, "--", "--steps", "20"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    code, out = finish(proc)
    assert code == 0, out
    assert "consistency sync with 1 backup workers, 3 workers" in out
    assert "staleness=" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 60 and summary["staleness_mean"] == 0
    assert procs.leftovers() == []


def test_a_bad_mode_is_refused_before_anything_starts(procs):
    proc = procs.start(paramserver("run", "--workers", "2", "--mode", "ssp", SMALL), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    code, out = finish(proc, timeout=60)
    assert code == 2 and "ssp needs a staleness bound" in out
    assert procs.leftovers() == []
