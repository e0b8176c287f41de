"""The data guarantee end to end (docs/elastic.md): the coordinator hands out the splits of the data
(paramserver.Splits), so each example is trained exactly once per epoch with no failure, whatever the
worker count does and across a resume or a roll-back; with a worker killed, at least once, and twice
only for the batches of its split trained after its last reported position.

The runs train tests/integration/scripts/train_dispatched.py, a counting model: each batch adds 1 to
its examples' cells, so the final cells say how often each example was trained; each worker prints
"read E S P" when it starts split S of epoch E at batch P and "trained E S P" after each step.
Trainer.fit trains tests/integration/scripts/dispatched_fit.py, the same counting model as a module.

Timings (when to scale, kill, stop) are seeded; replay a failure with PARAMSERVER_DATA_SEED=<the
seed in its message>.
"""

from __future__ import annotations

import collections
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from tests.fault.launcher_run import LauncherRun
from tests.wait import finished, wait_until

from paramserver.base.options.options import Options
from paramserver.data.splits import range_of
from paramserver.launch.local.run_files import RUN_DIR_ENV

pytestmark = pytest.mark.fault  # each test: one or two runs of 2-4 workers, 15-45 s

SCRIPT = "tests/integration/scripts/train_dispatched.py"
FIT = "tests/integration/scripts/dispatched_fit.py"
SEED = int(os.environ.get("PARAMSERVER_DATA_SEED", time.time_ns() % 1_000_000))
LINE = re.compile(r"^\[worker(\d+)\] (read|trained) (\d+) (\d+) (\d+)$")
TOOK_BACK = re.compile(r"dispatcher: took back split (\d+) of epoch (\d+) from worker (\d+) at batch (\d+)")


class Data:
    """The data a run trains: `examples` cut into `splits`, `batch` examples a batch."""

    def __init__(self, examples: int, splits: int, batch: int, epochs: int) -> None:
        self.examples, self.splits, self.batch, self.epochs = examples, splits, batch, epochs

    def args(self, out, pace: float, *more: str) -> list[str]:
        return [
            "--examples",
            str(self.examples),
            "--splits",
            str(self.splits),
            "--batch",
            str(self.batch),
            "--epochs",
            str(self.epochs),
            "--pace",
            str(pace),
            "--out",
            str(out),
            *more,
        ]

    def batches(self) -> list[tuple[int, int, int]]:
        """Every (epoch, split, batch) of the run."""
        return [
            (epoch, split, position)
            for epoch in range(self.epochs)
            for split in range(self.splits)
            for position in range(self.count(split))
        ]

    def count(self, split: int) -> int:
        start, stop = range_of(self.examples, self.splits, split)
        return -(-(stop - start) // self.batch)

    def examples_of(self, split: int, position: int) -> range:
        start, stop = range_of(self.examples, self.splits, split)
        return range(start + position * self.batch, min(start + (position + 1) * self.batch, stop))


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A runs directory of this test's own, so that `paramserver scale` with no run name finds its run."""
    folder = tmp_path / "runs"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(RUN_DIR_ENV, str(folder))
    return folder


def printed(lines: list[str], what: str) -> list[tuple[int, int, int, int]]:
    """(worker, epoch, split, position) of each "read" or "trained" line, in order."""
    found = []
    for line in list(lines):
        match = LINE.match(line.strip())
        if match and match[2] == what:
            found.append((int(match[1]), int(match[3]), int(match[4]), int(match[5])))
    return found


def trained_by(run: LauncherRun, worker: int) -> int:
    return sum(1 for w, *_ in printed(run.lines, "trained") if w == worker)


def wait_trained(run: LauncherRun, worker: int, count: int, timeout: float = 120) -> None:
    wait_until(
        lambda: trained_by(run, worker) >= count or run.proc.poll() is not None,
        f"worker {worker} to train {count} batches (seed {SEED})",
        timeout=timeout,
    )
    assert trained_by(run, worker) >= count, (SEED, run.output())


def cells_of(path) -> list[float]:
    return json.loads(path.read_text())


def check_exactly(cells: list[float], times: int, what: str) -> None:
    odd = {i: c for i, c in enumerate(cells) if c != times}
    assert not odd, (SEED, f"{what}: {len(odd)} examples not trained {times} times", dict(list(odd.items())[:12]))


def scale(procs, workers: int) -> None:
    """`paramserver scale N`, the real command, against the test's only run."""
    proc = procs.start(
        [sys.executable, "-m", "paramserver", "scale", str(workers)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and f"for {workers} workers" in out, (SEED, out)


def stopped(run: LauncherRun, sig: int, timeout: float = 120) -> int:
    """Send `sig` to `paramserver run`; its exit status once it and its output ended."""
    run.proc.send_signal(sig)
    code = run.proc.wait(timeout)
    finished(run._reader, "the reader of the launcher's output to reach its end")
    return code


# ---- 1. no failure --------------------------------------------------------------------------------
def test_with_no_failure_every_split_goes_out_once_per_epoch_and_every_example_is_trained_once_each(procs, tmp_path):
    data = Data(examples=400, splits=8, batch=10, epochs=2)
    run = LauncherRun(procs, ["--workers", "2"], SCRIPT, data.args(tmp_path / "out.json", pace=0.01))
    summary = run.finish(timeout=120)

    check_exactly(cells_of(tmp_path / "out.json"), data.epochs, "no failure")
    reads = sorted((e, s, p) for _, e, s, p in printed(run.lines, "read"))
    assert reads == [(e, s, 0) for e in range(data.epochs) for s in range(data.splits)], (SEED, reads)
    trained = collections.Counter((e, s, p) for _, e, s, p in printed(run.lines, "trained"))
    assert sorted(trained) == data.batches() and set(trained.values()) == {1}, (SEED, trained)
    by_worker = collections.Counter(w for w, *_ in printed(run.lines, "trained"))
    assert set(by_worker) == {0, 1}, (SEED, by_worker)  # both trained: the splits were shared
    assert summary["examples"] == data.examples * data.epochs, summary
    for epoch in range(1, data.epochs + 1):
        assert sum(f"dispatcher: epoch {epoch} of {data.epochs} done" in line for line in run.lines) == 1
    assert procs.leftovers() == [], SEED


# ---- 2. workers join, one is killed, one leaves -----------------------------------------------------
HEARTBEAT_S = Options().heartbeat_s  # `paramserver run` keeps the default (1 s): heartbeat_s has no flag
PACE = 0.05
# A killed worker's split goes back at the position of its last heartbeat: it trained at most one
# heartbeat interval of batches after it (each takes at least PACE), and one more may be in flight.
REPEAT_BOUND = math.ceil(HEARTBEAT_S / PACE) + 1


def test_workers_join_one_is_killed_one_leaves_and_only_the_killed_ones_last_batches_repeat(procs, tmp_path, run_dir):
    rng = random.Random(SEED)
    data = Data(examples=12000, splits=40, batch=10, epochs=1)
    hold = tmp_path / "hold"  # the last 4 splits go slowly until the test is done scaling
    flags = ["--workers", "2", "--max-workers", "4", "--max-restarts", "0", "--heartbeat-timeout", "3"]
    args = data.args(tmp_path / "out.json", PACE, "--hold", str(hold), "--hold-splits", "4", "--hold-pace", "0.3")
    run = LauncherRun(procs, flags, SCRIPT, args)
    wait_trained(run, 0, rng.randint(5, 40))
    scale(procs, 4)
    run.wait_for("scaling to 4 workers: started [2, 3], asked to leave []")
    wait_trained(run, 3, rng.randint(25, 60))  # past its first heartbeats with a position
    run.kill("worker3")  # no restart left (--max-restarts 0): a leave, not a failure
    run.wait_for("no restart left: the others go on")
    run.wait_for("from worker 3 at batch", timeout=60)  # found dead: its connection closed, or the timeout
    wait_trained(run, 2, trained_by(run, 2) + rng.randint(2, 20))
    scale(procs, 2)
    run.wait_for("worker2 left the run")
    hold.write_text("")
    summary = run.finish(timeout=120)

    assert summary["max_workers"] == 4, summary
    cells = cells_of(tmp_path / "out.json")
    assert min(cells) >= 1, (SEED, "an example was never trained", [i for i, c in enumerate(cells) if c < 1][:10])
    took_back = {int(m[3]): (int(m[2]), int(m[1]), int(m[4])) for m in map(TOOK_BACK.search, run.lines) if m}
    assert set(took_back) <= {2, 3} and 3 in took_back, (SEED, took_back)
    epoch, split, position = took_back[3]
    mine = [p for w, e, s, p in printed(run.lines, "trained") if (w, e, s) == (3, epoch, split)]
    assert mine and position <= max(mine) + 1, (SEED, position, mine)
    # the taken-back position is at most a heartbeat interval (and the batch in flight) behind worker 3
    assert max(mine) + 1 - position <= REPEAT_BOUND, (SEED, f"split {split} taken back at {position}", mine[-3:])
    repeated = {i for i, c in enumerate(cells) if c > 1}
    allowed = {i for p in range(position, max(mine) + 2) if p < data.count(split) for i in data.examples_of(split, p)}
    assert repeated <= allowed and max(cells) <= 2, (
        SEED,
        f"repeats outside split {split}'s batches {position}..{max(mine) + 1}",
        sorted(repeated - allowed)[:10],
    )
    assert len(repeated) <= REPEAT_BOUND * data.batch, (SEED, len(repeated), REPEAT_BOUND)
    if 2 in took_back:  # the clean leave handed its split back where it stopped: its last step's batch or the next
        epoch2, split2, position2 = took_back[2]
        mine2 = [p for w, e, s, p in printed(run.lines, "trained") if (w, e, s) == (2, epoch2, split2)]
        last2 = max(mine2, default=position2 - 1)  # none: it left before its first step of that split
        assert position2 - last2 in (1, 2), (SEED, f"worker 2 left split {split2} at {position2}", last2)
    # each split was started at batch 0 once; read again only where a split taken back was resumed (the
    # clean leave's at its exact position: it caused no repeat, checked above)
    reads = printed(run.lines, "read")
    first: dict[tuple[int, int], int] = {}
    for _, e, s, p in reads:
        first.setdefault((e, s), p)
    assert first == {(0, s): 0 for s in range(data.splits)}, (SEED, first)
    again = [(e, s, p) for _, e, s, p in reads]
    for (e, s), p in first.items():
        again.remove((e, s, p))
    assert sorted(again) == sorted(took_back.values()), (SEED, again, took_back)
    assert procs.leftovers() == [], SEED


# ---- 3. resume onto another worker count, roll-back ------------------------------------------------
def test_a_preempted_run_resumed_with_another_worker_count_trains_each_example_once_per_epoch(procs, tmp_path):
    rng = random.Random(SEED)
    data = Data(examples=1200, splits=6, batch=10, epochs=2)
    ckpt = str(tmp_path / "ckpt")
    args = data.args(tmp_path / "out.json", 0.05)
    first = LauncherRun(procs, ["--workers", "2", "--checkpoint-dir", ckpt, "--checkpoint-every", "15"], SCRIPT, args)
    wait_trained(first, 0, rng.randint(20, 80))  # mid-epoch: an epoch is 120 batches
    assert stopped(first, rng.choice([signal.SIGTERM, signal.SIGINT])) == 130, (SEED, first.output())
    assert any("preemption checkpoint written after step" in line for line in first.lines), (SEED, first.output())
    assert not (tmp_path / "out.json").exists()

    resumed = LauncherRun(procs, ["--workers", "3", "--checkpoint-dir", ckpt, "--resume"], SCRIPT, args)
    summary = resumed.finish(timeout=120)
    check_exactly(cells_of(tmp_path / "out.json"), data.epochs, f"resumed with 3 workers (seed {SEED})")
    again = printed(resumed.lines, "trained")
    assert len(again) < len(data.batches()), (SEED, "the resumed run started over", len(again))
    assert {w for w, *_ in again} == {0, 1, 2}, SEED
    assert (0, 0, 0) not in [(e, s, p) for _, e, s, p in printed(resumed.lines, "read")], SEED
    assert summary["workers"] == 3
    assert procs.leftovers() == [], SEED


def test_a_ps_killed_rolls_the_positions_back_with_the_values_and_each_example_is_trained_once_per_epoch(
    procs, tmp_path
):
    rng = random.Random(SEED)
    data = Data(examples=1200, splits=6, batch=10, epochs=2)
    flags = [
        "--workers",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "30",
        "--max-restarts",
        "2",
    ]
    run = LauncherRun(procs, flags, SCRIPT, data.args(tmp_path / "out.json", 0.05))
    run.wait_for(": committed (")  # the chief's step 30 (of about 120)
    wait_trained(run, 0, trained_by(run, 0) + rng.randint(1, 15))  # before the next one, at step 60
    run.kill("ps0")
    run.wait_for("rolling the whole cluster back")
    run.wait_for("dispatcher: restored at epoch")
    run.finish(timeout=150)

    check_exactly(cells_of(tmp_path / "out.json"), data.epochs, f"rolled back (seed {SEED})")
    trained = collections.Counter((e, s, p) for _, e, s, p in printed(run.lines, "trained"))
    # the batches trained after the checkpoint's cut were trained again after the roll-back, yet count once
    assert sorted(trained) == data.batches() and max(trained.values()) == 2, (SEED, trained)
    assert procs.leftovers() == [], SEED


# ---- 4. Trainer.fit with a Splits loader ------------------------------------------------------------
def test_trainer_fit_with_splits_trains_each_example_once_per_epoch_and_returns_each_epochs_metrics(procs, tmp_path):
    examples, epochs = 240, 2
    args = [
        "--examples",
        str(examples),
        "--splits",
        "6",
        "--batch",
        "10",
        "--epochs",
        str(epochs),
        "--out",
        str(tmp_path / "out.json"),
    ]
    run = LauncherRun(procs, ["--workers", "2"], FIT, args)
    run.finish(timeout=120)

    check_exactly(cells_of(tmp_path / "out.json"), epochs, "Trainer.fit")
    histories = {
        int(line.split("]")[0][len("[worker") :]): json.loads(line.split(" history ")[1])
        for line in run.lines
        if " history [" in line
    }
    assert set(histories) == {0, 1}, (SEED, run.output())
    per_epoch = collections.Counter()
    for history in histories.values():
        assert [m[0] for m in history] == sorted(m[0] for m in history), history  # in epoch order
        for epoch, steps, seen, loss in history:
            assert 1 <= epoch <= epochs and seen == 10 * steps and math.isfinite(loss), history
            per_epoch[epoch] += seen
    assert per_epoch == {epoch: examples for epoch in range(1, epochs + 1)}, histories
    assert procs.leftovers() == []
