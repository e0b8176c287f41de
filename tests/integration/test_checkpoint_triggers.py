"""A checkpoint, whatever asked for it (the chief's step count, its clock, RequestCheckpoint calls),
is one barrier that every worker meets: runs with seeded random step timings where the chief is
slow and worker 1 fast, so that workers deciding their own pauses waited at different barriers
for ever (the chief at the clock's, worker 1 at its 50th step's). Each run must end, every time."""

import json
import random
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.conftest import ROOT

pytestmark = pytest.mark.cluster  # nine short two-worker runs, three at a time

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "train_checkpoint_triggers.py")
BASE_SEED = random.randrange(1 << 20)
RUN_TIMEOUT_S = 90  # a run takes ~8 s; one that hangs never ends


def run(procs, tmp_path, seed: int, *flags: str, script_args: tuple[str, ...] = ()) -> dict:
    directory = tmp_path / f"ckpt-{seed}"
    proc = procs.start([sys.executable, "-m", "paramserver", "run", "--ps", "1", "--workers", "2",
                        "--progress-every", "0", "--checkpoint-dir", str(directory), "--checkpoint-every", "50",
                        *flags, SCRIPT, "--", "--seed", str(seed), *script_args],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the launcher stops its nodes
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"seed {seed}: the run hung (no end in {RUN_TIMEOUT_S} s); its log ends:\n{out[-4000:]}")
    assert proc.returncode == 0, f"seed {seed}:\n{out[-4000:]}"
    summary = json.loads(out.strip().splitlines()[-1])
    announced, written = summary["checkpoints_announced"], summary["checkpoints_written"]
    # every announced checkpoint was written once (and the final one, unless the last one held it)
    assert summary["checkpoints_failed"] == 0 and announced <= written <= announced + 1, f"seed {seed}: {summary}"
    assert "checkpoint@" not in out, f"seed {seed}: a worker paused on its own count"
    return summary


def run_all(procs, tmp_path, seeds: list[int], *flags: str, script_args: tuple[str, ...] = ()) -> list[dict]:
    """`run` for each seed, three at a time: a run mostly sleeps through its seeded step timings, and
    the others' load only moves those timings further apart."""
    pool = ThreadPoolExecutor(3)
    try:
        return list(pool.map(lambda seed: run(procs, tmp_path, seed, *flags, script_args=script_args), seeds))
    finally:
        pool.shutdown(cancel_futures=True)  # a failure: the runs not started yet never start


def test_the_chiefs_step_count_and_clock_make_one_barrier_every_worker_meets(procs, tmp_path):
    seeds = [BASE_SEED + run_index for run_index in range(6)]
    for seed, summary in zip(seeds, run_all(procs, tmp_path, seeds, "--checkpoint-every-seconds", "1")):
        assert summary["checkpoints_announced"] >= 3, f"seed {seed}: {summary}"  # the clock's, and steps 50 and 100
    assert procs.leftovers() == [], f"seeds {seeds}"


def test_bursts_of_checkpoint_requests_merge_into_barriers_every_worker_meets(procs, tmp_path):
    seeds = [BASE_SEED + 100 + run_index for run_index in range(3)]
    for seed, summary in zip(seeds, run_all(procs, tmp_path, seeds, script_args=("--bursts", "4"))):
        assert summary["checkpoints_announced"] >= 2, f"seed {seed}: {summary}"
    assert procs.leftovers() == [], f"seeds {seeds}"
