"""Partial recovery (`--recovery partial`): a PS killed with -9 restores its own shard from its newest
checkpoint while the other shard keeps its state and the workers keep their data positions.

tests/integration/scripts/train_counted.py with `--copies 2` keeps one variable of counted cells
on each PS (every batch marks its cell in both), so the final cells show, per shard, which batches
it applied: the killed shard lost exactly the batches between its checkpoint and the kill (the
run's closing line says how many, per worker), the other shard lost none, and no batch was applied
twice (no worker redid a step). The other PS is the same process before and after the recovery,
its version never went back. Under `paramserver run` and under restart loops (Kubernetes' way).

Replay a failure with PARAMSERVER_CHAOS_SEED=<the seed in its message>.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest
from tests.fault.launcher_run import LauncherRun
from tests.fault.test_in_cluster_recovery import start_cluster

from paramserver.base.errors import ParamServerError
from paramserver.client.ps_client import hello
from paramserver.transport.grpc_transport import GrpcChannel

pytestmark = pytest.mark.fault  # two small clusters, one PS killed in each: about 40 s

SCRIPT = "tests/integration/scripts/train_counted.py"
BATCHES, WORKERS, EVERY = 80, 2, "20"
SEED = int(os.environ.get("PARAMSERVER_CHAOS_SEED", time.time_ns() % 1_000_000))
WAIT_S = 120.0  # only stops a hung test: every wait is for a line or an exit


def shard_state(address: str) -> tuple[str, int]:
    """(incarnation, version) of the PS at `address`."""
    channel = GrpcChannel(address, 1 << 26, use_stream=False)
    try:
        channel.wait_ready(10.0)
        meta = hello(channel)
        return meta["incarnation"], meta["version"]
    finally:
        channel.close()


def lost_batches(copy: list[list[float]], replay: str) -> dict[int, list[int]]:
    """Each worker's batches a copy of the cells does not hold; every other one is there exactly once."""
    values = {round(v, 5) for row in copy for v in row}
    assert values <= {0.0, 1.0}, (replay, copy)  # a batch applied twice would show 2
    return {worker: [b for b, v in enumerate(row) if round(v, 5) == 0.0] for worker, row in enumerate(copy)}


def check_cells(cells: list[list[list[float]]], victim: int, by_worker: dict[str, int], replay: str) -> None:
    """The other shard's copy holds every batch once; the victim's lacks exactly the steps each worker
    was told its shard lost: one run of consecutive batches per worker, before the kill, none after."""
    assert lost_batches(cells[1 - victim], replay) == {w: [] for w in range(WORKERS)}, (replay, cells)
    lost = lost_batches(cells[victim], replay)
    for worker, batches in lost.items():
        assert len(batches) == by_worker.get(str(worker), 0), (replay, worker, batches, by_worker)
        assert batches == list(range(batches[0], batches[0] + len(batches))) if batches else True, (replay, batches)
    assert sum(map(len, lost.values())) > 0 or sum(by_worker.values()) == 0, (replay, lost)


def test_a_killed_ps_restores_its_shard_alone_under_the_launcher(procs, tmp_path):
    rng = random.Random(SEED)
    victim, after_s = rng.randrange(2), rng.uniform(0.05, 0.4)
    replay = f"seed {SEED} (PARAMSERVER_CHAOS_SEED={SEED}): ps{victim} killed {after_s:.2f}s after a checkpoint"
    out = tmp_path / "cells.json"
    run = LauncherRun(procs, ["--ps", "2", "--workers", str(WORKERS), "--mode", "async", "--recovery", "partial",
                              "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", EVERY],
                      SCRIPT, ["--batches", str(BATCHES), "--pace", "0.03", "--copies", "2", "--out", str(out)])
    try:
        seen = run.wait_for("worker 1 at batch", run.wait_for(": committed"))  # a checkpoint to restore from
        address = _ps_address(run, 1 - victim)
        before = shard_state(address)
        time.sleep(after_s)
        run.kill(f"ps{victim}")
        run.wait_for("restoring shard", seen)
        back = run.wait_for(f"ps {victim} is back", seen)
        after = shard_state(address)
        summary = run.finish()
    except AssertionError as exc:
        raise AssertionError(f"{replay}\n{exc}") from None
    assert back > seen, replay
    assert after[0] == before[0] and after[1] >= before[1], (replay, before, after)  # same process, not rolled back
    assert "steps_redone" not in summary, (replay, summary)
    [recovery] = summary["partial_recoveries"]
    assert recovery["shard"] == victim and recovery["steps_lost"] == sum(recovery["by_worker"].values()), replay
    check_cells(json.loads(out.read_text()), victim, recovery["by_worker"], replay)
    assert procs.leftovers() == [], replay


def _ps_address(run: LauncherRun, index: int) -> str:
    """PS `index`'s address, from the cluster file `paramserver run` announced."""
    line = run.lines[run.wait_for("cluster file: ")]
    path = line.split("cluster file: ", 1)[1].split(" (", 1)[0]
    return json.loads(open(path).read())["cluster"]["ps"][index]


def test_a_killed_ps_restores_its_shard_alone_under_restart_loops(procs, tmp_path):
    rng = random.Random(SEED + 1)
    victim, after_s = rng.randrange(2), rng.uniform(0.05, 0.4)
    replay = f"seed {SEED + 1} (PARAMSERVER_CHAOS_SEED={SEED}): ps{victim} killed {after_s:.2f}s after a checkpoint"
    options = {"mode": "async", "checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": int(EVERY),
               "recovery": "partial"}
    out = tmp_path / "cells.json"
    loops = start_cluster(procs, tmp_path, options, WORKERS, ["--batches", str(BATCHES), "--pace", "0.03",
                                                              "--copies", "2", "--out", str(out)])
    chief = loops["worker0"]
    try:
        chief.wait_for(": committed", WAIT_S)  # a checkpoint to restore from
        loops["worker1"].wait_for("worker 1 at batch", WAIT_S, len(loops["worker1"].lines))
        address = json.loads(loops["ps0"].env["TF_CONFIG"])["cluster"]["ps"][1 - victim]
        before = shard_state(address)
        time.sleep(after_s)
        loops[f"ps{victim}"].kill()
        chief.wait_for(f"ps {victim} is back", WAIT_S)
        after = shard_state(address)
        for name, loop in loops.items():
            if name.startswith("worker"):
                assert loop.wait_done(WAIT_S) == 0, loop.log()
    except (AssertionError, ParamServerError) as exc:
        raise AssertionError(f"{replay}\n{exc}\n" + "\n".join(loop.log(30) for loop in loops.values())) from None
    finally:
        for loop in loops.values():
            loop.stop()
    assert after[0] == before[0] and after[1] >= before[1], (replay, before, after)
    by_worker = {}
    for name, loop in loops.items():
        if name.startswith("worker"):
            assert loop.exits == [0], (replay, loop.log())  # no worker restarted: none redid a step
            lines = [line for line in loop.lines if f"ps {victim} is back" in line]
            assert len(lines) == 1, (replay, loop.log())
            by_worker[name.removeprefix("worker")] = int(lines[0].split("lost ")[1].split(" step")[0])
    check_cells(json.loads(out.read_text()), victim, by_worker, replay)
