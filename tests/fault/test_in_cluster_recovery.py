"""Recovery inside the cluster: `paramserver node` per node under a restart loop (standing in for
Kubernetes' restartPolicy), no launcher. A PS killed with -9 restarts from the latest checkpoint
and the cluster rolls back to it by itself; the chief killed with -9 restarts and rolls the PS
back; a worker killed with -9 rejoins alone. In async and sync mode. The run finishes by itself,
every worker's position in the final checkpoint is its number of batches, and every batch's update
was applied exactly once (tests/integration/scripts/train_counted.py marks one cell per batch).

Replay a failure with PARAMSERVER_CHAOS_SEED=<the seed in its message>.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

import pytest
from tests.fault.test_lifecycle import WORKERS, check_every_batch_trained_once
from tests.ports import free_port
from tests.restart_loop import RestartLoop

from paramserver.base.lifecycle import RESTART_EXIT_CODE

pytestmark = pytest.mark.fault  # a cluster of five restart loops through three kills: one to three minutes

SCRIPT = "tests/integration/scripts/train_counted.py"
BATCHES = 90  # per worker: long enough for three kills
SEED = int(os.environ.get("PARAMSERVER_CHAOS_SEED", time.time_ns() % 1_000_000))
WAIT_S = 180.0  # only stops a hung test: every wait is for a line or an exit


def start_cluster(procs, tmp_path, options: dict, workers: int = WORKERS,
                  args: list[str] | None = None) -> dict[str, RestartLoop]:
    """2 PS and 3 workers (worker 0 hosts the coordinator), each `paramserver node` under a restart loop;
    the workers run SCRIPT with `args` (default: BATCHES batches, paced, the cells into tmp_path)."""
    cluster = {"ps": [f"127.0.0.1:{free_port()}" for _ in range(2)],
               "worker": [f"127.0.0.1:{free_port()}" for _ in range(workers)]}
    args = args or ["--batches", str(BATCHES), "--pace", "0.05", "--out", str(tmp_path / "cells.json")]
    loops = {}
    for role, addresses in cluster.items():
        for index in range(len(addresses)):
            env = procs.env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": role, "index": index}}),
                            PARAMSERVER_OPTIONS=json.dumps(options))
            script = [] if role == "ps" else [SCRIPT, *args]
            argv = [sys.executable, "-m", "paramserver", "--log-level", "INFO", "node", *script]
            loops[f"{role}{index}"] = RestartLoop(procs, argv, env, max_restarts=20, name=f"{role}{index}").start()
    return loops


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_cluster_under_restart_loops_recovers_from_a_ps_the_chief_and_a_worker_killed(procs, tmp_path, mode):
    seed = SEED + (mode == "sync")
    rng = random.Random(seed)
    ps_victim, first_kill, later = rng.randrange(2), rng.choice([20, 30, 40]), rng.choice([1, 2])
    replay = f"{mode}, seed {seed} (PARAMSERVER_CHAOS_SEED={SEED}): ps{ps_victim} at batch {first_kill}, " \
             f"then the chief, then worker{later}"
    options = {"mode": mode, "checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 15,
               "split_bytes": 256}  # the cells variable spreads over both PS: each holds state
    loops = start_cluster(procs, tmp_path, options)
    chief, worker = loops["worker0"], loops[f"worker{later}"]
    try:
        loops["worker1"].wait_for(f"worker 1 at batch {first_kill}", WAIT_S)
        seen = len(chief.lines)
        loops[f"ps{ps_victim}"].kill()
        loops[f"ps{ps_victim}"].wait_restarted(2, WAIT_S)  # its restart loop started it again
        seen = chief.wait_for("worker 0 starts at batch", WAIT_S, seen)  # the chief rolled the cluster back
        seen = chief.wait_for(": committed", WAIT_S, seen) + 1  # training again: a checkpoint after it
        chief.kill()
        chief.wait_for("restarted from the latest checkpoint", WAIT_S, seen)  # the new chief restarted the PS
        resumed = worker.wait_for(f"worker {later} starts at batch", WAIT_S, len(worker.lines))
        worker.wait_for(f"worker {later} at batch", WAIT_S, resumed)
        worker.kill()
        for loop in loops.values():
            if loop.name.startswith("worker"):
                assert loop.wait_done(WAIT_S) == 0, loop.log()
    except AssertionError as exc:
        raise AssertionError(f"{replay}\n{exc}\n" + "\n".join(loop.log(30) for loop in loops.values())) from None
    finally:
        for loop in loops.values():
            loop.stop()
    check_every_batch_trained_once(mode, json.loads((tmp_path / "cells.json").read_text()), tmp_path / "ckpt", replay,
                                   BATCHES)
    codes = {code for loop in loops.values() for code in loop.exits}
    assert RESTART_EXIT_CODE in codes, f"{replay}: exits {({n: loop.exits for n, loop in loops.items()})}"
    exits = {name: loop.exits for name, loop in loops.items()}
    assert codes <= {0, -9, RESTART_EXIT_CODE}, f"{replay}\nexits {exits}\n" + "\n".join(loop.log() for loop in loops.values())
    assert procs.leftovers() == [], replay
