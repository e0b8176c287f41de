"""How a `paramserver run` ends: a node killed without a way to recover, a run that trained nothing."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
from tests.conftest import ROOT

pytestmark = pytest.mark.cluster

SMALL = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")


def paramserver(*args: str) -> list[str]:
    return [sys.executable, "-m", "paramserver", *args]


def _node(launcher: int, role: str) -> psutil.Process:
    """The launcher's PS 0 ("ps") or worker 0 ("chief")."""
    for child in psutil.Process(launcher).children():
        argv, env = child.cmdline(), child.environ()
        if role == "ps" and "--role" in argv and argv[argv.index("--role") + 1] == "ps":
            return child
        if role == "chief" and '"task": {"type": "worker", "index": 0}' in env.get("TF_CONFIG", ""):
            return child
    raise AssertionError(f"no {role} under {launcher}")


@pytest.mark.parametrize("role", ["chief", "ps"])
def test_a_killed_chief_or_ps_without_checkpoints_ends_with_128_plus_the_signal_and_says_what_recovers(procs, role):
    seed = random.randrange(2**32)
    delay = random.Random(seed).uniform(0.0, 0.5)
    proc = procs.start(paramserver("run", "--workers", "2", "--progress-every", "0.2", SMALL, "--", "--steps", "0"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("[run] steps="):
            break
    time.sleep(delay)
    os.kill(_node(proc.pid, role).pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    out = "".join(seen) + out
    assert proc.returncode == 137, f"seed {seed}: {out}"
    label = "worker0 failed: " if role == "chief" else "ps0 "
    assert (f"[run] {label}was killed (signal 9); stopping the run (with --checkpoint-dir the run rolls back "
            f"to its latest checkpoint and goes on)") in out, f"seed {seed}: {out}"
    assert "steps" in json.loads(out.strip().splitlines()[-1]), f"seed {seed}: {out}"
    assert procs.leftovers() == [], f"seed {seed}"


TORCH_OPTIM = str(ROOT / "tests" / "integration" / "scripts" / "train_torch_optim.py")


@pytest.mark.parametrize("torch_worker", [-1, 1], ids=["every-worker", "one-worker"])
def test_a_torch_optim_optimizer_is_named_when_a_worker_or_the_run_trained_no_step(procs, torch_worker):
    proc = procs.start(paramserver("run", "--workers", "2", "--progress-every", "0", TORCH_OPTIM, "--",
                                   "--torch-worker", str(torch_worker)),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    if torch_worker == -1:
        assert "[run] no worker trained a step: a cluster trains through paramserver optimizers" in out, out
        assert "worker 0: the script made no paramserver optimizer" in out
    else:
        assert "[run] worker1 trained no step while the others did: a cluster trains through" in out, out
        assert "worker 1: the script made no paramserver optimizer" in out
        assert "worker 0: the script made no" not in out
    assert "torch.optim optimizer trains a private copy" in out
    assert procs.leftovers() == []


def test_the_default_log_tells_the_runs_story_not_every_join_leave_barrier_and_audit_event(procs, tmp_path):
    proc = procs.start(paramserver("run", "--workers", "2", "--progress-every", "0", "--checkpoint-dir",
                                   str(tmp_path / "ckpt"), "--checkpoint-every", "10", SMALL, "--", "--steps", "20"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "[worker1] worker 1/2 done: checksum" in out  # the script's own prints
    assert "serving on" in out and "committed" in out and "drained" in out  # start, checkpoints, end
    for detail in ("paramserver.audit", "waits at 'checkpoint", "coordinator: worker 1 joined", "worker 0 left",
                   "registered group"):
        assert detail not in out, (detail, out)
    assert procs.leftovers() == []


RESUME = str(ROOT / "tests" / "integration" / "scripts" / "train_resume.py")


def test_after_a_roll_back_the_closing_line_counts_the_steps_trained_and_every_checkpoint(procs, tmp_path):
    proc = procs.start(paramserver("run", "--progress-every", "0.1", "--checkpoint-dir", str(tmp_path / "ckpt"),
                                   "--checkpoint-every", "50", RESUME, "--", "--steps", "200", "--step-sleep", "0.05"),
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:  # after checkpoint 50, before 100: the kill undoes some steps
        seen.append(line)
        if line.startswith("[run] steps=") and int(line.split()[1].split("=")[1].replace(",", "")) >= 65:
            break
    os.kill(_node(proc.pid, "ps").pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=120)
    out = "".join(seen) + out
    assert proc.returncode == 0, out
    assert "rolling the whole cluster back" in out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["resumed_from"] == 50, out
    assert summary["steps"] == 200, summary  # 50 before the checkpoint, 150 after it: each step once
    assert 15 <= summary["steps_redone"] < 50, summary
    assert summary["checkpoints_written"] == 4, summary  # 50 before the roll-back; 100, 150, 200 after
    assert procs.leftovers() == []
