"""`paramserver run` and `paramserver demo`: real processes, prefixed logs, exit codes, no leftovers."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from tests.conftest import ROOT
from tests.wait import wait_until

from paramserver.launch.local.processes import Child, stop_all

pytestmark = pytest.mark.cluster  # whole clusters of processes: a minute for this file

SMALL = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")
CHILD_MEMORY = str(ROOT / "tests" / "integration" / "scripts" / "child_memory.py")
THEN_BLOCK = str(ROOT / "tests" / "integration" / "scripts" / "train_then_block.py")


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


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _count(line: str, key: str) -> int:
    return int(re.search(rf"\b{key}=([\d,]+)", line).group(1).replace(",", ""))


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a shell's background job (CI, nohup ... &) inherits


@pytest.mark.parametrize("sig, inherited", [(signal.SIGINT, None), (signal.SIGTERM, None),
                                            (signal.SIGINT, _ignore_sigint)], ids=["int", "term", "int-ignored"])
def test_interrupting_the_launcher_stops_every_node_and_counts_no_step_after_it(procs, sig, inherited):
    proc = procs.start(paramserver("run", "--ps", "1", "--workers", "2", "--progress-every", "0.2", SMALL, "--",
                                   "--steps", "0"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       preexec_fn=inherited)
    registered = set()
    for line in proc.stdout:  # wait until both workers train
        if "parameters registered" in line:
            registered.add(line.split()[0])
        if registered == {"[worker0]", "[worker1]"} and line.startswith("[run] steps=") and _count(line, "steps") >= 20:
            break
    nodes = psutil.Process(proc.pid).children()
    assert len(nodes) == 3
    gone = []

    def watch(started: float) -> None:  # a figure to print, not a verdict
        while any(_alive(node) for node in nodes):
            time.sleep(0.01)
        gone.append(time.monotonic() - started)

    watcher = threading.Thread(target=watch, args=(time.monotonic(),))
    proc.send_signal(sig)
    watcher.start()
    code, out = finish(proc, timeout=60)
    watcher.join()
    print(f"signal to every node gone: {gone[0]:.2f}s")
    assert code == 130, out
    lines = out.splitlines()
    interrupted = [i for i, line in enumerate(lines) if line.startswith("[run] interrupted at steps=")]
    assert len(interrupted) == 1, out
    at_interrupt = lines[interrupted[0]]
    summary = json.loads(lines[-1])
    # the board froze at the interrupt: the steps the workers took while stopping are not counted
    assert summary["steps"] == _count(at_interrupt, "steps") > 0
    assert summary["examples"] == _count(at_interrupt, "examples")
    later = [_count(line, "steps") for line in lines[interrupted[0]:] if line.startswith("[run] steps=")]
    assert all(steps <= summary["steps"] for steps in later)
    assert not any(_alive(node) for node in nodes)  # every node was gone before the launcher exited
    assert procs.leftovers() == []


_WAITS_FOR_ALL = """
import os, signal, sys, time
folder, index, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
def on_term(*_):  # exits only once every sibling got its SIGTERM too
    open(os.path.join(folder, index), "w").close()
    while len(os.listdir(folder)) < count:
        time.sleep(0.01)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_stopping_nodes_signals_all_of_them_before_waiting_for_any(procs, tmp_path):
    count, ready = 4, threading.Semaphore(0)
    children = [Child(f"node{i}", [sys.executable, "-c", _WAITS_FOR_ALL, str(tmp_path), str(i), str(count)],
                      procs.env(), lambda label, line: ready.release() if line == "ready" else None)
                for i in range(count)]
    try:
        for _ in children:
            ready.acquire()
        # stopped one at a time, the first would wait for its siblings' SIGTERM until SIGKILLed
        assert stop_all(children, grace=120.0) == [0] * count
    finally:
        for child in children:
            child.kill()
    assert procs.leftovers() == []


def test_a_worker_killed_after_it_finished_is_not_restarted(procs):
    proc = procs.start(paramserver("run", "--ps", "1", "--workers", "2", "--progress-every", "0", THEN_BLOCK, "--",
                                   "--steps", "30"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        assert "restarting it alone" not in line and "rolling the whole cluster back" not in line, "".join(lines)
        found = re.match(r"\[worker1\] worker 1 finished; pid (\d+); blocking", line)
        if found:
            os.kill(int(found.group(1)), signal.SIGKILL)
    proc.wait(60)
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert "[run] worker1 was killed (signal 9) after it finished; not restarting it" in out
    summary = json.loads(lines[-1])
    assert summary["steps"] == 60
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
    wait_until(lambda: procs.leftovers() == [], "the killed launcher's nodes to exit", interval=0.1)


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
    # a worker that starts late joins the step under way with its first gradient (staleness <= 1), never dropped
    assert summary["steps"] == 60 and summary["staleness_mean"] <= 1
    assert procs.leftovers() == []


def test_a_bad_mode_is_refused_before_anything_starts(procs):
    proc = procs.start(paramserver("run", "--workers", "2", "--mode", "ssp", SMALL), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    code, out = finish(proc, timeout=60)
    assert code == 2 and "ssp needs a staleness bound" in out
    assert procs.leftovers() == []
