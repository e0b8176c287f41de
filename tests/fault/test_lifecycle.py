"""Any order of starts, finishes and restarts: the run finishes by itself, every batch trained once.

For each mode (async, sync, sync + 1 backup, ssp:2) one real cluster of 2 PS and 3 workers runs
tests/integration/scripts/train_counted.py, where each batch marks its own cell of a PS
variable. Workers start with seeded skews of 0-5 s, one of them is 10x slower, and seeded kills
(-9) hit a worker while it trains and then a PS, the chief, or a worker just after it finished.
Each run must end with code 0, every worker's position in the final checkpoint must be its
number of batches (none skipped, none counted twice), and the cells must show each batch
applied exactly once (async and ssp: 1; sync: 1/k for a step of k workers; with a backup a
late batch may be dropped, 0).

Replay a failure with PARAMSERVER_CHAOS_SEED=<the seed in its message>.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from tests.conftest import ROOT
from tests.fault.launcher_run import LauncherRun

pytestmark = pytest.mark.fault  # clusters with kills, ten digits runs, two CTR runs: five to eight minutes

SCRIPT = "tests/integration/scripts/train_counted.py"
BATCHES, WORKERS = 60, 3
SEED = int(os.environ.get("PARAMSERVER_CHAOS_SEED", time.time_ns() % 1_000_000))
MODES = {"async": ["--mode", "async"], "sync": ["--mode", "sync"],
         "sync-backup": ["--mode", "sync", "--backup-workers", "1"], "ssp": ["--mode", "ssp:2"]}


def plan(rng: random.Random) -> list[tuple[str, str]]:
    """(line to wait for, node to kill) in order: a worker while it trains; then, once it is back
    (its restart is sure to print that line), a PS, the chief, or a worker just after it finished
    (the restarted one finishes later, so such a line is sure to come)."""
    victim = rng.choice([1, 2])
    first = (f"worker {victim} at batch {rng.choice([10, 20, 30])}", f"worker{victim}")
    back = f"worker {victim} starts at batch"
    second = rng.choice(["ps", "chief", "finished"])
    if second == "ps":
        return [first, (back, f"ps{rng.randrange(2)}")]
    if second == "chief":
        return [first, (back, "worker0")]
    return [first, (back, None), ("finished its data", "the worker that finished")]


def finished_worker(line: str) -> str:
    return line.split("]")[0].lstrip("[")  # "[worker2] ... finished its data" -> worker2


@pytest.mark.parametrize("mode", list(MODES))
def test_a_run_finishes_by_itself_whatever_the_order_of_starts_finishes_and_kills(procs, tmp_path, mode):
    seed = SEED + list(MODES).index(mode)
    rng = random.Random(seed)
    slow = rng.randrange(WORKERS)
    events = plan(rng)
    out = tmp_path / "cells.json"
    run = LauncherRun(procs, ["--ps", "2", "--workers", str(WORKERS), *MODES[mode], "--heartbeat-timeout", "30",
                              "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "15"],
                      SCRIPT, ["--batches", str(BATCHES), "--skew-seed", str(seed), "--slow-worker", str(slow),
                               "--out", str(out)])
    replay = f"seed {seed} (PARAMSERVER_CHAOS_SEED={SEED}): slow worker {slow}, {events}"
    seen = 0
    try:
        for trigger, victim in events:
            seen = run.wait_for(trigger, seen)
            while victim == "the worker that finished" and run.lines[seen].startswith("[worker0]"):
                seen = run.wait_for(trigger, seen + 1)  # the chief's own finish: wait for another's
            if victim is not None:
                run.kill(finished_worker(run.lines[seen]) if victim == "the worker that finished" else victim)
            seen += 1
        run.finish()
    except AssertionError as exc:
        raise AssertionError(f"{replay}\n{exc}") from None
    check_every_batch_trained_once(mode, json.loads(out.read_text()), tmp_path / "ckpt", replay)
    assert procs.leftovers() == [], replay


def check_every_batch_trained_once(mode: str, cells: list[list[float]], directory, replay: str,
                                   batches: int = BATCHES) -> None:
    from paramserver.checkpoint.restore import RestoreSource
    from paramserver.checkpoint.store import CheckpointStore

    store = CheckpointStore(str(directory))
    positions = RestoreSource(store, store.complete()[-1]).positions
    assert positions == {w: batches for w in range(WORKERS)}, (replay, positions)
    values = {round(v, 5) for row in cells for v in row}
    if mode in ("async", "ssp"):
        assert values == {1.0}, (replay, cells)
    elif mode == "sync":
        assert values <= {1.0, 0.5, round(1 / 3, 5)}, (replay, cells)
    else:
        assert values <= {0.0, 1.0, 0.5, round(1 / 3, 5)} and min(map(max, cells)) > 0, (replay, cells)


def test_digits_in_sync_mode_with_a_backup_worker_passes_ten_runs_of_ten(procs):
    """The workers' data is uneven (1,437 digits over 3 workers): the two that finish first must
    not hold the third's last steps at a quorum it cannot reach. Two runs at a time: a run's nodes
    mostly wait on each other's steps, and the other run's load only varies the order of finishes."""
    def attempt(number: int) -> tuple[int, dict]:
        run = LauncherRun(procs, ["--ps", "2", "--workers", "3", "--mode", "sync", "--backup-workers", "1"],
                          "examples/digits.py", ["--epochs", "1"])
        return number, run.finish()

    pool = ThreadPoolExecutor(2)
    try:
        for number, summary in pool.map(attempt, range(10)):
            assert summary["examples"] == 1437, (number, summary)  # every worker trained all of its data
            assert summary["test_accuracy"] > 0.5, (number, summary)
    finally:
        pool.shutdown(cancel_futures=True)  # a failure: the runs not started yet never start
    assert procs.leftovers() == []


def test_the_ctr_example_survives_a_killed_ps_then_a_killed_worker_at_the_same_auc(procs, tmp_path):
    """examples/ctr.py on 2 PS + 2 workers with checkpoints every 25 steps: kill -9 a PS (the
    cluster rolls back), then worker 1 (restarted alone: its data resumes at its own position).
    The run finishes by itself with the held-out AUC of an undisturbed run (within 0.01)."""
    data = {}
    for name, rows, seed in (("train", 24_000, 1), ("test", 6_000, 2)):
        data[name] = tmp_path / f"{name}.tsv"
        subprocess.run([sys.executable, str(ROOT / "examples" / "ctr_data.py"), "--rows", str(rows), "--vocab",
                        "50000", "--seed", str(seed), "--out", str(data[name])], check=True, timeout=120)
    args = ["--train", str(data["train"]), "--test", str(data["test"]), "--batch-size", "128",
            "--table-rows", "100000"]

    def ctr_run(directory):
        return LauncherRun(procs, ["--ps", "2", "--workers", "2", "--checkpoint-dir", str(directory),
                                   "--checkpoint-every", "25"], "examples/ctr.py", args)
    undisturbed = ctr_run(tmp_path / "undisturbed").finish()
    run = ctr_run(tmp_path / "disturbed")
    seen = run.wait_for("ckpt-000000025: committed") + 1
    run.kill("ps1")
    seen = run.wait_for("cluster restarted", seen) + 1
    seen = run.wait_for(": committed", seen) + 1  # training again after the roll-back
    run.kill("worker1")
    summary = run.finish()
    log = "".join(run.lines)
    assert "rolling the whole cluster back" in log
    assert "worker1 was killed (signal 9); restarting it alone" in log or "after it finished" in log
    assert abs(summary["test_auc"] - undisturbed["test_auc"]) <= 0.01, (summary, undisturbed)
    assert procs.leftovers() == []
