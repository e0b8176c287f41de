"""Elastic runs with real processes (docs/elastic.md): workers join (`paramserver scale`, or
`paramserver node` with TF_CONFIG that lists no workers) and leave (a scale-down's SIGTERM, or
kill -9) while async, ssp and sync runs train.

Async and ssp runs train tests/integration/scripts/elastic_counted.py: each batch marks its own cell,
so the final cells show every applied push exactly once. The sync run trains a linear model
(tests/integration/scripts/elastic_sync.py) whose workers log, per step, the sync step their push
went into: plain torch replays it (each step: the mean gradient of the workers that pushed it, at
that step's values) and must end at the same parameters.

The timings (when to scale, when to kill) are seeded; replay a failure with
PARAMSERVER_ELASTIC_SEED=<the seed in its message>.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import threading
import time

import pytest
import torch
from tests.conftest import ROOT
from tests.fault.launcher_run import LauncherRun
from tests.ports import free_port
from tests.wait import finished, wait_until

from paramserver.base.config import Options
from paramserver.launch.local.run_files import RUN_DIR_ENV

pytestmark = pytest.mark.fault  # each test: one run of 2-5 workers that join and leave, 20-40 s

COUNTED = "tests/integration/scripts/elastic_counted.py"
SYNC = "tests/integration/scripts/elastic_sync.py"
SEED = int(os.environ.get("PARAMSERVER_ELASTIC_SEED", time.time_ns() % 1_000_000))
HEARTBEAT_TIMEOUT = 6.0
# Nothing may wait for a worker that left, and in async mode nothing waits for one that died. A wait
# for a dead worker lasts until the coordinator finds it dead: about the heartbeat timeout less one
# heartbeat. Half the timeout tells such a stall from a slow step on a loaded machine.
MAX_STALL_S = HEARTBEAT_TIMEOUT / 2
# A worker whose process dies is found when its heartbeat's connection closes: within about one heartbeat
# (`heartbeat_s`, 1 s) and the coordinator's next look (another), far below the default heartbeat timeout.
KILL_STALL_S = 2.5
BATCH = re.compile(r"^(?:\[worker(\d+)\] )?batch (\d+) (\d+) ([\d.]+)$")  # the launcher's prefix, or a node's
PUSHED = re.compile(r"^\[worker(\d+)\] pushed (\d+) (\d+) (\d+)")


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A runs directory of this test's own, so that `paramserver scale` with no run name finds its run."""
    folder = tmp_path / "runs"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv(RUN_DIR_ENV, str(folder))
    return folder


def elastic_run(
    procs,
    tmp_path,
    mode: str,
    workers: int,
    max_workers: int,
    script: str = COUNTED,
    *more: str,
    heartbeat_timeout: float | None = HEARTBEAT_TIMEOUT,
) -> LauncherRun:
    """`paramserver run` with one PS and `script`; `heartbeat_timeout` None: the option's default."""
    args = [
        "--batches",
        "4000",
        "--pace",
        "0.02",
        "--stop",
        str(tmp_path / "stop"),
        "--out",
        str(tmp_path / "out.json"),
        *more,
    ]
    flags = [
        "--ps",
        "1",
        "--mode",
        mode,
        "--workers",
        str(workers),
        "--max-workers",
        str(max_workers),
        "--max-restarts",
        "0",
    ]
    if heartbeat_timeout is not None:
        flags += ["--heartbeat-timeout", str(heartbeat_timeout)]
    return LauncherRun(procs, flags, script, args)


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


def stop_training(tmp_path) -> None:
    (tmp_path / "stop").write_text("")


def batches(lines: list[str]) -> dict[int, list[tuple[int, float]]]:
    """Each worker's "batch W B T" lines: (B, T), in order."""
    found: dict[int, list[tuple[int, float]]] = collections.defaultdict(list)
    for line in list(lines):
        match = BATCH.match(line.strip())
        if match:
            assert match[1] in (None, match[2]), line
            found[int(match[2])].append((int(match[3]), float(match[4])))
    return found


def reported(lines: list[str], worker: int) -> int:
    """How many batches `worker` reported trained; they must be 0, 1, ... in order."""
    numbers = [b for b, _ in batches(lines)[worker]]
    assert numbers == list(range(len(numbers))), (SEED, worker, numbers[:20])
    return len(numbers)


def latest(lines: list[str], worker: int) -> tuple[int, float]:
    found = batches(lines)[worker]
    return found[-1] if found else (-1, 0.0)


def wait_batch(run: LauncherRun, worker: int, batch: int) -> int:
    return run.wait_for(f"[worker{worker}] batch {worker} {batch} ", timeout=120)


def left_after(run: LauncherRun, worker: int) -> int:
    """The step after which `worker` left (its log line: each step pushed one batch)."""
    line = run.lines[run.wait_for(f"worker {worker} leaves the run after step ")]
    return int(line.split("after step ")[1].split()[0])


def longest_stall(times: list[float]) -> tuple[float, float]:
    """The longest time between two consecutive steps, and when it began."""
    return max(((b - a, a) for a, b in zip(times, times[1:])), default=(0.0, 0.0))


def check_cells(cells: list[list[float]], exact: dict[int, int], killed: dict[int, int]) -> None:
    """`exact`: workers whose first n batches (and no other) each added exactly 1. `killed`: workers
    killed after reporting n batches: those n each added 1, the one in flight at most 1, no later one."""
    for worker, row in enumerate(cells):
        if worker in exact:
            n = exact[worker]
            assert row == [1.0] * n + [0.0] * (len(row) - n), (SEED, worker, n, _marks(row))
        elif worker in killed:
            n = killed[worker]
            assert row[:n] == [1.0] * n and row[n] in (0.0, 1.0) and set(row[n + 1 :]) <= {0.0}, (
                SEED,
                worker,
                n,
                _marks(row),
            )
        else:
            assert set(row) == {0.0}, (SEED, worker, _marks(row))


def _marks(row: list[float]) -> str:
    """A row's cells that are not 1 up to its last mark, for a failure's message."""
    last = max((i for i, v in enumerate(row) if v), default=-1)
    odd = {i: v for i, v in enumerate(row[: last + 1]) if v != 1.0}
    return f"marked up to batch {last}; cells not 1 before that: {dict(list(odd.items())[:10])}"


def events(summary: dict) -> list[tuple[int, str]]:
    membership = summary["membership"]
    times = [event["t"] for event in membership]
    assert times == sorted(times), (SEED, membership)
    return [(event["worker"], event["event"]) for event in membership]


def test_async_workers_join_one_is_killed_one_leaves_and_every_batch_counts_once(procs, tmp_path, run_dir):
    rng = random.Random(SEED)
    run = elastic_run(procs, tmp_path, "async", workers=2, max_workers=4)
    wait_batch(run, 0, rng.randint(10, 60))
    scale(procs, 4)
    run.wait_for("scaling to 4 workers: started [2, 3], asked to leave []")
    wait_batch(run, 3, rng.randint(5, 40))
    run.kill("worker3")  # no restart left (--max-restarts 0): a leave, not a failure
    killed_at = time.time()
    run.wait_for("no restart left: the others go on")
    wait_batch(run, 2, rng.randint(5, 80))
    scale(procs, 2)  # slot 3 is gone already: slot 2 is the highest running
    run.wait_for("scaling to 2 workers: started [], asked to leave [2]")
    run.wait_for("worker2 left the run")
    # the chief trains past the time the coordinator finds worker 3 dead, then every worker stops
    wait_until(
        lambda: latest(run.lines, 0)[1] > killed_at + HEARTBEAT_TIMEOUT + 1.0,
        f"the chief to train past the heartbeat timeout after the kill (seed {SEED})",
        timeout=120,
    )
    stop_training(tmp_path)
    summary = run.finish(timeout=120)

    assert summary["max_workers"] == 4
    assert events(summary) == [
        (0, "started"),
        (1, "started"),
        (2, "started"),
        (3, "started"),
        (3, "died"),
        (2, "asked to leave"),
        (2, "left"),
    ], (SEED, summary["membership"])
    cells = json.loads((tmp_path / "out.json").read_text())
    counts = {worker: reported(run.lines, worker) for worker in range(4)}
    left = left_after(run, 2)  # its last step pushed and applied, then it left inside that step
    assert left in (counts[2], counts[2] + 1), (SEED, left, counts)
    check_cells(cells, exact={0: counts[0], 1: counts[1], 2: left}, killed={3: counts[3]})
    chief = [t for _, t in batches(run.lines)[0]]
    stall, since = longest_stall([t for t in chief if killed_at - 1.0 <= t <= killed_at + HEARTBEAT_TIMEOUT + 1.0])
    assert stall < MAX_STALL_S, (
        SEED,
        f"the chief made no step for {stall:.2f}s from {since - killed_at:+.2f}s after the kill",
    )
    stall, since = longest_stall(chief)
    assert stall < MAX_STALL_S, (SEED, f"the chief made no step for {stall:.2f}s from {since - chief[0]:.2f}s")
    assert procs.leftovers() == [], SEED


def test_ssp_a_worker_joins_and_leaves_without_stalling_the_others(procs, tmp_path, run_dir):
    rng = random.Random(SEED)
    run = elastic_run(procs, tmp_path, "ssp:2", workers=2, max_workers=3)
    # far enough in that a newcomer whose ssp clock started at 0 would hold the others back for seconds
    wait_batch(run, 0, rng.randint(150, 250))
    scale(procs, 3)
    run.wait_for("scaling to 3 workers: started [2], asked to leave []")
    joined = run.wait_for("[worker2] batch 2 0 ")
    joined_at = float(run.lines[joined].split()[-1])
    wait_batch(run, 2, rng.randint(10, 60))
    # its leave would end a stall its join caused: the others train on past any stall that counts first
    wait_until(
        lambda: latest(run.lines, 0)[1] > joined_at + MAX_STALL_S + 0.5,
        f"the chief to train on after worker 2 joined (seed {SEED})",
        timeout=120,
    )
    scale(procs, 2)
    run.wait_for("worker2 left the run")
    left_at = time.time()
    wait_until(lambda: latest(run.lines, 0)[1] > left_at + 1.0, f"the chief to train on (seed {SEED})", timeout=120)
    stop_training(tmp_path)
    summary = run.finish(timeout=120)

    assert events(summary) == [(0, "started"), (1, "started"), (2, "started"), (2, "asked to leave"), (2, "left")], (
        SEED,
        summary["membership"],
    )
    counts = {worker: reported(run.lines, worker) for worker in range(3)}
    left = left_after(run, 2)
    assert left in (counts[2], counts[2] + 1), (SEED, left, counts)
    check_cells(json.loads((tmp_path / "out.json").read_text()), exact={0: counts[0], 1: counts[1], 2: left}, killed={})
    for worker in (0, 1):
        stall, since = longest_stall([t for _, t in batches(run.lines)[worker]])
        assert stall < MAX_STALL_S, (
            SEED,
            f"worker {worker} made no step for {stall:.2f}s from "
            f"{since - joined_at:+.2f}s after worker 2's first step "
            f"({left_at - joined_at:.2f}s after it: its leave)",
        )
    assert procs.leftovers() == [], SEED


def _sync_script():
    spec = importlib.util.spec_from_file_location("elastic_sync", ROOT / SYNC)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def replay(steps: dict[int, list[tuple[int, int]]]) -> torch.nn.Linear:
    """Plain torch: each sync step, the mean gradient of the (worker, batch) pushes it took, at its values."""
    script = _sync_script()
    net = script.model()
    for step in sorted(steps):
        grads = []
        for worker, k in steps[step]:
            net.zero_grad()
            script.loss_of(net, worker, k).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        with torch.no_grad():
            for i, param in enumerate(net.parameters()):
                param -= script.LR * torch.stack([g[i] for g in grads]).mean(0)
    return net


def test_sync_a_worker_joins_and_leaves_and_the_result_equals_plain_torch(procs, tmp_path, run_dir):
    rng = random.Random(SEED)
    run = elastic_run(procs, tmp_path, "sync", workers=2, max_workers=3, script=SYNC)
    run.wait_for(f"[worker0] pushed 0 {rng.randint(10, 80)} ", timeout=120)
    scale(procs, 3)
    run.wait_for(f"[worker2] pushed 2 {rng.randint(10, 60)} ", timeout=120)
    scale(procs, 2)
    run.wait_for("worker2 left the run")
    left_at = time.time()
    run.wait_for("[worker0] pushed 0 ", after=len(run.lines))  # the others train on without it
    leave_seen = len(run.lines)
    run.wait_for("[worker0] pushed 0 ", after=leave_seen + 20)
    stop_training(tmp_path)
    summary = run.finish(timeout=120)

    assert events(summary) == [(0, "started"), (1, "started"), (2, "started"), (2, "asked to leave"), (2, "left")], (
        SEED,
        summary["membership"],
    )
    steps: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    by_worker: dict[int, list[tuple[int, int, float]]] = collections.defaultdict(list)
    for line in list(run.lines):
        match = PUSHED.match(line.strip())
        if match:
            worker, k, step = int(match[2]), int(match[3]), int(match[4])
            steps[step].append((worker, k))
            by_worker[worker].append((k, step, float(line.split()[-1]) if len(line.split()) > 5 else 0.0))
    assert sorted(steps) == list(range(len(steps))), (SEED, "sync steps missing", sorted(steps)[:10])
    for worker, pushes in by_worker.items():
        # each worker's k-th batch went into one step, its steps consecutive: it took part in every
        # step while it was present (a joining worker in the step under way, the others in each one)
        assert [k for k, _, _ in pushes] == list(range(len(pushes))), (SEED, worker)
        first = pushes[0][1]
        assert [s for _, s, _ in pushes] == list(range(first, first + len(pushes))), (SEED, worker, pushes[:5])
    assert by_worker[0][0][1] == 0, SEED  # worker 1 joins the step under way when it registers: not always 0
    three = [s for s, pushers in steps.items() if len(pushers) == 3]
    assert three and len(three) == len(by_worker[2]), (SEED, len(three), len(by_worker[2]))
    got = json.loads((tmp_path / "out.json").read_text())
    reference = replay(steps)
    for name, value in (("weight", reference.weight), ("bias", reference.bias)):
        error = ((torch.tensor(got[name]) - value).norm() / value.norm()).item()
        assert error < 1e-5, (SEED, name, error)
    chief = [t for _, _, t in by_worker[0]]
    stall, since = longest_stall(chief)
    assert stall < MAX_STALL_S, (
        SEED,
        f"the chief made no step for {stall:.2f}s from {since - left_at:+.2f}s after worker 2 left",
    )
    assert procs.leftovers() == [], SEED


def kill_at_a_seeded_moment(run: LauncherRun, rng: random.Random, label: str) -> float:
    """SIGKILL the node `label` a seeded part of a heartbeat (1 s, the period of its long poll) after the
    line the test waited for; returns when."""
    time.sleep(rng.uniform(0.0, 1.0))
    run.kill(label)
    return time.time()


def found_gone_by_its_connection(run: LauncherRun, worker: int) -> None:
    """The coordinator dropped the killed `worker` because its heartbeat's connection closed (not after the
    heartbeat timeout, which would name the seconds of silence)."""
    gone = f"coordinator: worker {worker} is gone: its heartbeat's connection closed"
    wait_until(
        lambda: any(gone in line for line in list(run.lines)),
        f"{gone!r} (seed {SEED})",
        timeout=30,
    )


def test_ssp_a_worker_that_joined_and_is_killed_holds_the_others_one_heartbeat_at_most(procs, tmp_path, run_dir):
    """The heartbeat timeout is the default (30 s): only the closed connection of the killed worker's
    heartbeat can free the others from its ssp bound within KILL_STALL_S."""
    assert Options().heartbeat_timeout_s >= 10 * KILL_STALL_S, SEED
    rng = random.Random(SEED)
    run = elastic_run(procs, tmp_path, "ssp:2", workers=2, max_workers=3, heartbeat_timeout=None)
    wait_batch(run, 0, rng.randint(10, 60))
    scale(procs, 3)
    run.wait_for("scaling to 3 workers: started [2], asked to leave []")
    wait_batch(run, 2, rng.randint(10, 60))
    killed_at = kill_at_a_seeded_moment(run, rng, "worker2")  # no restart left (--max-restarts 0): a leave
    run.wait_for("no restart left: the others go on")
    found_gone_by_its_connection(run, 2)
    # the others train on past any stall that counts, then every worker stops
    wait_until(
        lambda: min(latest(run.lines, worker)[1] for worker in (0, 1)) > killed_at + KILL_STALL_S + 1.0,
        f"workers 0 and 1 to train on after the kill (seed {SEED})",
        timeout=120,
    )
    stop_training(tmp_path)
    summary = run.finish(timeout=120)

    assert events(summary) == [(0, "started"), (1, "started"), (2, "started"), (2, "died")], (
        SEED,
        summary["membership"],
    )
    counts = {worker: reported(run.lines, worker) for worker in range(3)}
    assert counts[2] > 0, (SEED, counts)
    check_cells(
        json.loads((tmp_path / "out.json").read_text()), exact={0: counts[0], 1: counts[1]}, killed={2: counts[2]}
    )
    for worker in (0, 1):
        times = [t for _, t in batches(run.lines)[worker]]
        stall, since = longest_stall([t for t in times if t >= killed_at - 1.0])
        print(f"seed {SEED}: worker {worker}'s longest gap around the kill {stall:.2f}s, {since - killed_at:+.2f}s on")
        assert stall < KILL_STALL_S, (
            SEED,
            f"worker {worker} made no step for {stall:.2f}s from {since - killed_at:+.2f}s after the kill",
        )
        stall, since = longest_stall(times)
        assert stall < MAX_STALL_S, (
            SEED,
            f"worker {worker} made no step for {stall:.2f}s from {since - killed_at:+.2f}s after the kill",
        )
    assert procs.leftovers() == [], SEED


def sync_pushes(lines: list[str]) -> tuple[dict[int, list[tuple[int, int]]], dict[int, list[tuple[int, int, float]]]]:
    """elastic_sync.py's "pushed W K S [T]" lines: each sync step's (worker, batch) pushes, and each worker's
    (batch, step, time) in order (time 0.0 on the line of a worker that left inside its step)."""
    steps: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    by_worker: dict[int, list[tuple[int, int, float]]] = collections.defaultdict(list)
    for line in list(lines):
        match = PUSHED.match(line.strip())
        if match:
            worker, k, step = int(match[2]), int(match[3]), int(match[4])
            steps[step].append((worker, k))
            by_worker[worker].append((k, step, float(line.split()[-1]) if len(line.split()) > 5 else 0.0))
    return steps, by_worker


def relative_error(got: dict, net: torch.nn.Linear) -> float:
    return max(
        ((torch.tensor(got[name]) - value).norm() / value.norm()).item()
        for name, value in (("weight", net.weight), ("bias", net.bias))
    )


def test_sync_a_worker_that_joined_and_is_killed_leaves_the_quorum_within_a_heartbeat(procs, tmp_path, run_dir):
    """One PS, the default heartbeat timeout (30 s): the step under way at the kill waits for the killed
    worker only until its heartbeat's connection closes; every later step is the survivors' own."""
    assert Options().heartbeat_timeout_s >= 10 * KILL_STALL_S, SEED
    rng = random.Random(SEED)
    run = elastic_run(procs, tmp_path, "sync", workers=2, max_workers=3, script=SYNC, heartbeat_timeout=None)
    run.wait_for(f"[worker0] pushed 0 {rng.randint(10, 80)} ", timeout=120)
    scale(procs, 3)
    run.wait_for(f"[worker2] pushed 2 {rng.randint(10, 60)} ", timeout=120)
    killed_at = kill_at_a_seeded_moment(run, rng, "worker2")
    run.wait_for("no restart left: the others go on")
    found_gone_by_its_connection(run, 2)
    wait_until(
        lambda: sync_pushes(run.lines)[1][0][-1][2] > killed_at + KILL_STALL_S + 1.0,
        f"the chief to train on after the kill (seed {SEED})",
        timeout=120,
    )
    stop_training(tmp_path)
    summary = run.finish(timeout=120)

    assert events(summary) == [(0, "started"), (1, "started"), (2, "started"), (2, "died")], (
        SEED,
        summary["membership"],
    )
    steps, by_worker = sync_pushes(run.lines)
    chief = [t for _, _, t in by_worker[0]]
    stall, since = longest_stall([t for t in chief if t >= killed_at - 1.0])
    print(f"seed {SEED}: the chief's longest gap around the kill {stall:.2f}s, {since - killed_at:+.2f}s on")
    assert stall < KILL_STALL_S, (
        SEED,
        f"the chief made no step for {stall:.2f}s from {since - killed_at:+.2f}s after the kill",
    )
    stall, since = longest_stall(chief)
    assert stall < MAX_STALL_S, (
        SEED,
        f"the chief made no step for {stall:.2f}s from {since - killed_at:+.2f}s after the kill",
    )
    assert sorted(steps) == list(range(len(steps))), (SEED, "sync steps missing", sorted(steps)[:10])
    for worker, pushes in by_worker.items():
        assert [k for k, _, _ in pushes] == list(range(len(pushes))), (SEED, worker)
        first = pushes[0][1]
        assert [s for _, s, _ in pushes] == list(range(first, first + len(pushes))), (SEED, worker, pushes[:5])
    assert by_worker[0][0][1] == 0, SEED
    # every step has the push of each worker present then: worker 2 from its join to its last logged
    # step, and none of it after (its push in flight at the kill, batch last_k + 1, logged nothing)
    last_k, last_step, _ = by_worker[2][-1]
    for step, pushers in sorted(steps.items()):
        present = [w for w, pushes in sorted(by_worker.items()) if pushes[0][1] <= step <= pushes[-1][1]]
        assert sorted(w for w, _ in pushers) == present, (SEED, step, pushers, f"worker 2 last in step {last_step}")
    after = [step for step in steps if step > last_step]
    assert len(after) > 10, (SEED, "the survivors trained on for a few steps only", after)
    # the result is plain torch's with the survivors alone from the kill on (the in-flight push may or
    # may not be in the step under way, last_step + 1). The model forgets early steps (the difference
    # the in-flight push makes has faded by the end): this checks the steps near the end, the survivors'.
    got = json.loads((tmp_path / "out.json").read_text())
    without = relative_error(got, replay(steps))
    in_flight = {**steps, last_step + 1: [*steps[last_step + 1], (2, last_k + 1)]}
    within = relative_error(got, replay(in_flight))
    assert min(without, within) < 1e-5, (SEED, f"equals no replay: {without=:.2e} {within=:.2e}", last_k, last_step)
    assert procs.leftovers() == [], SEED


class Node:
    """One `paramserver node` process of the test, its output collected line by line."""

    def __init__(self, procs, tf_config: dict, options: dict, args: list[str]) -> None:
        env = procs.env(TF_CONFIG=json.dumps(tf_config), PARAMSERVER_OPTIONS=json.dumps(options))
        self.proc = procs.start(
            [sys.executable, "-m", "paramserver", "--log-level", "INFO", "node", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(
            target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), name="test-node-output"
        )
        self._reader.start()

    def wait_for(self, text: str, timeout: float = 120) -> None:
        wait_until(
            lambda: any(text in line for line in list(self.lines)) or self.proc.poll() is not None,
            f"{text!r} (seed {SEED})",
            timeout=timeout,
        )
        assert any(text in line for line in list(self.lines)), (SEED, text, "".join(self.lines[-40:]))

    def finish(self, timeout: float = 120) -> str:
        self.proc.wait(timeout)
        finished(self._reader, "the reader of a node's output")
        out = "".join(self.lines)
        assert self.proc.returncode == 0, (SEED, out[-4000:])
        return out


def test_tf_config_with_no_worker_list_takes_workers_that_join_later(procs, tmp_path):
    """TFJob's dynamic-worker form: the cluster names the chief and the PS only; workers 0 and 1 join
    (slots 1 and 2), then 2 and 3 (slots 3 and 4), and every one trains."""
    rng = random.Random(SEED)
    options = {"max_workers": 5, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT}
    ps_node, ps_address = procs.start_ps(PARAMSERVER_OPTIONS=json.dumps(options))
    cluster = {"chief": [f"127.0.0.1:{free_port()}"], "ps": [ps_address]}
    args = [
        str(ROOT / COUNTED),
        "--batches",
        "4000",
        "--pace",
        "0.02",
        "--stop",
        str(tmp_path / "stop"),
        "--out",
        str(tmp_path / "out.json"),
    ]

    def start(kind: str, index: int) -> Node:
        return Node(procs, {"cluster": cluster, "task": {"type": kind, "index": index}}, options, args)

    chief = start("chief", 0)
    first = [start("worker", i) for i in (0, 1)]
    for slot, node in enumerate(first, 1):
        node.wait_for(f"batch {slot} {rng.randint(5, 40)} ")
    later = [start("worker", i) for i in (2, 3)]
    for slot, node in enumerate(later, 3):
        node.wait_for(f"batch {slot} {rng.randint(5, 40)} ")
    stop_training(tmp_path)
    outputs = [node.finish() for node in [*first, *later]]
    chief_out = chief.finish()
    for slot in range(5):
        assert f"coordinator: worker {slot} joined" in chief_out, (SEED, slot, chief_out[-4000:])
    assert chief_out.count("joined\n") == 5, (SEED, chief_out[-4000:])
    counts = {0: reported(chief.lines, 0)} | {
        slot: reported(node.lines, slot) for slot, node in enumerate([*first, *later], 1)
    }
    assert all(counts.values()), (SEED, counts)
    check_cells(json.loads((tmp_path / "out.json").read_text()), exact=counts, killed={})
    for slot, out in enumerate(outputs, 1):
        assert f"worker {slot} of 5 slots starts" in out, (SEED, slot)
    ps_node.terminate()
    assert ps_node.wait(30) == 0, SEED
    assert procs.leftovers() == [], SEED


def test_a_scale_up_while_workers_still_leave_waits_for_their_slots(procs, tmp_path, run_dir):
    """`paramserver scale 2` then `scale 4` while slots 2 and 3 are still leaving (their workers take
    4 s to go): the launcher starts no slot beyond the run's 4 (a node would refuse the index, and its
    failure end the run), and starts slots 2 and 3 again once their workers left."""
    rng = random.Random(SEED)
    run = elastic_run(procs, tmp_path, "async", 4, 4, COUNTED, "--linger", "4")
    for worker in range(4):
        wait_batch(run, worker, rng.randint(5, 30))
    scale(procs, 2)
    asked = run.wait_for("scaling to 2 workers: started [], asked to leave [3, 2]")
    scale(procs, 4)
    run.wait_for("scaling to 4 workers", after=asked + 1)
    run.wait_for("worker2 left the run")
    run.wait_for("worker3 left the run")
    run.wait_for("worker 2 of 4 slots starts", after=asked + 1)
    run.wait_for("worker 3 of 4 slots starts", after=asked + 1)
    stop_training(tmp_path)
    summary = run.finish(timeout=120)
    assert not any(line.startswith(("[worker4]", "[worker5]")) for line in run.lines), (SEED, run.output())
    happened = events(summary)
    assert happened[:6] == [
        (0, "started"),
        (1, "started"),
        (2, "started"),
        (3, "started"),
        (3, "asked to leave"),
        (2, "asked to leave"),
    ], (SEED, happened)
    assert sorted(happened[6:]) == [(2, "left"), (2, "started"), (3, "left"), (3, "started")], (SEED, happened)
    for slot in (2, 3):
        assert happened.index((slot, "left")) < happened.index((slot, "started"), 4), (SEED, happened)
    assert procs.leftovers() == [], SEED
