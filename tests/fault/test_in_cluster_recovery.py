"""Recovery inside the cluster: `paramserver node` per node under a restart loop (standing in for
Kubernetes' restartPolicy), no launcher. A PS killed with -9 restarts from the latest checkpoint
and the cluster rolls back to it by itself; the chief killed with -9 restarts and rolls the PS
back; a worker killed with -9 rejoins alone. The run finishes by itself, every worker's position in
the final checkpoint is its number of batches, and every batch's update was applied exactly once
(tests/integration/scripts/train_counted.py marks one cell per batch).

Replay a failure with PARAMSERVER_CHAOS_SEED=<the seed in its message>.
"""

from __future__ import annotations

import json
import os
import random
import socket
import time

import pytest

from paramserver.base.lifecycle import RESTART_EXIT_CODE
from tests.fault.restart_loops import NodeLoops

pytestmark = pytest.mark.slow  # a cluster of five restart loops through three kills: about a minute

SCRIPT = "tests/integration/scripts/train_counted.py"
BATCHES, WORKERS = 90, 3
SEED = int(os.environ.get("PARAMSERVER_CHAOS_SEED", time.time_ns() % 1_000_000))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(procs, loops: NodeLoops, tmp_path, options: dict) -> dict:
    cluster = {"ps": [f"127.0.0.1:{free_port()}" for _ in range(2)],
               "worker": [f"127.0.0.1:{free_port()}" for _ in range(WORKERS)]}
    out = tmp_path / "cells.json"
    for role, addresses in cluster.items():
        for index in range(len(addresses)):
            env = procs.env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": role, "index": index}}),
                            PARAMSERVER_OPTIONS=json.dumps(options))
            args = ["node"] if role == "ps" else ["node", SCRIPT, "--batches", str(BATCHES), "--pace", "0.05",
                                                  "--out", str(out)]
            loops.start(f"{role}{index}", args, env)
    return cluster


@pytest.mark.timeout(900)
def test_a_cluster_under_restart_loops_recovers_from_a_ps_the_chief_and_a_worker_killed(procs, tmp_path):
    rng = random.Random(SEED)
    ps_victim, first_kill, later_worker = rng.randrange(2), rng.choice([20, 30, 40]), rng.choice([1, 2])
    replay = f"seed {SEED}: ps{ps_victim} at batch {first_kill}, then the chief, then worker{later_worker}"
    options = {"checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 15, "heartbeat_timeout_s": 30.0,
               "split_bytes": 256}  # the cells variable spreads over both PS: each holds state
    loops = NodeLoops(procs)
    start_cluster(procs, loops, tmp_path, options)
    try:
        seen = loops.wait_for(f"worker 1 at batch {first_kill}")
        loops.kill(f"ps{ps_victim}")
        seen = loops.wait_for(f"[ps{ps_victim}] PARAMSERVER_READY", seen)  # its restart loop started it again
        seen = loops.wait_for("worker 0 starts at batch", seen)  # the chief rolled the cluster back
        seen = loops.wait_for("committed", seen)  # training again: a checkpoint after the roll-back
        loops.kill("worker0")
        seen = loops.wait_for("restarted from the latest checkpoint", seen)  # the new chief restarted the PS
        seen = loops.wait_for(f"worker {later_worker} starts at batch", seen)
        seen = loops.wait_for(f"worker {later_worker} at batch", seen)
        loops.kill(f"worker{later_worker}")
        loops.wait_done([f"worker{i}" for i in range(WORKERS)])
    except AssertionError as exc:
        raise AssertionError(f"{replay}\n{exc}") from None
    finally:
        loops.stop()
    check_every_batch_trained_once(json.loads((tmp_path / "cells.json").read_text()), tmp_path / "ckpt", replay)
    codes = {code for exits in loops.exits.values() for code in exits}
    assert RESTART_EXIT_CODE in codes, (replay, loops.exits)  # the roll-back went through the restart loops
    assert codes <= {0, -9, RESTART_EXIT_CODE}, (replay, loops.exits, loops.log())  # no node failed on its own
    assert procs.leftovers() == []


def check_every_batch_trained_once(cells: list[list[float]], directory, replay: str) -> None:
    from paramserver.checkpoint.restore import RestoreSource
    from paramserver.checkpoint.store import CheckpointStore

    store = CheckpointStore(str(directory))
    positions = RestoreSource(store, store.complete()[-1]).positions
    assert positions == {w: BATCHES for w in range(WORKERS)}, (replay, positions)
    assert {round(v, 5) for row in cells for v in row} == {1.0}, (replay, cells)
