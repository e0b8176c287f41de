"""`paramserver status` with several runs of this user on the machine (they are listed, with owner and
start time, and one is chosen by name, pid or run file), and its STEP column as the run's step."""

import json
import os
import pwd
import time

import numpy as np
import pytest

from paramserver.base.config import ClusterSpec
from paramserver.base.errors import ConfigError
from paramserver.checkpoint.files import shard_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointStore, checkpoint_name
from paramserver.coordinator.coordinator_service import SERVICE as COORDINATOR
from paramserver.coordinator.coordinator_service import CoordinatorService
from paramserver.coordinator.membership import Coordinator
from paramserver.launch.cli.parser import parse_args
from paramserver.launch.cli.status_command import describe, runs_table, status
from paramserver.launch.local import run_files
from paramserver.launch.local.run_files import LauncherFiles, local_run, local_runs, started_at
from paramserver.launch.status import NodeStatus, _fill_workers, cluster_status, resumed_from, run_step
from paramserver.server.shard import Shard
from paramserver.server.shard_service import ShardService
from paramserver.tables.table_store import TableStore
from paramserver.transport.grpc_transport import GrpcServer

IMPORTED = time.time()  # this process started before: its launcher start time is no later
FIRST = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
SECOND = {"ps": ["127.0.0.1:3", "127.0.0.1:4"], "worker": ["127.0.0.1:5", "127.0.0.1:6", "127.0.0.1:7"]}


def main(argv: list[str]) -> int:
    """`paramserver ARGV`'s status command, without the process-wide set-up of the entry point."""
    return status(parse_args(argv))


@pytest.fixture
def two_runs(tmp_path, monkeypatch):
    """Two runs of this user's (both launched by this process: one pid, two names)."""
    monkeypatch.setenv(run_files.RUN_DIR_ENV, str(tmp_path / "runs"))
    monkeypatch.delenv("TF_CONFIG", raising=False)
    files = [LauncherFiles.create(), LauncherFiles.create()]
    paths = [files[0].write(FIRST), files[1].write(SECOND)]
    yield paths
    for f in files:
        f.remove()


def test_every_trusted_run_is_listed_with_its_owner_and_start_time(two_runs):
    runs, refused = local_runs()
    assert refused == [] and sorted(run.path for run in runs) == sorted(two_runs)
    me = pwd.getpwuid(os.getuid()).pw_name
    for run in runs:
        described = describe(run)
        assert described["owner"] == me and described["pid"] == os.getpid()
        assert IMPORTED - 3600 < run.started_at <= IMPORTED + 1  # ticks after boot, as Unix time
        assert described["started"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(run.started_at))
        assert "pytest" in described["command"] or "python" in described["command"]
    by_name = {describe(run)["run"]: describe(run) for run in runs}
    assert {(d["ps"], d["workers"]) for d in by_name.values()} == {(1, 1), (2, 3)}
    table = runs_table(runs).splitlines()
    assert table[0].split() == ["RUN", "PID", "OWNER", "STARTED", "PS", "WORKERS", "COMMAND"]
    assert len(table) == 3 and all(me in line and line.split()[0] in by_name for line in table[1:])


def test_a_run_is_chosen_by_its_name_or_run_file_never_guessed(two_runs):
    with pytest.raises(ConfigError, match="2 runs of yours on this machine: name one"):
        local_run()
    for path, cluster in zip(two_runs, (FIRST, SECOND)):
        for choice in (path.stem, str(path), path.name):
            assert list(local_run(choice=choice).cluster.ps) == cluster["ps"]
    with pytest.raises(ConfigError, match=f"'{os.getpid()}' names 2 runs"):
        local_run(choice=str(os.getpid()))
    with pytest.raises(ConfigError, match=r"no run 'run-1-00' of yours on this machine \(your runs: run-"):
        local_run(choice="run-1-00")


def test_status_with_two_runs_lists_both_and_exits_2_saying_how_to_choose(two_runs, capsys):
    assert main(["status", "--json"]) == 2
    out, err = capsys.readouterr()
    assert sorted(run["file"] for run in json.loads(out)) == sorted(str(p) for p in two_runs)
    assert "2 runs of yours on this machine: choose one with `paramserver status RUN`" in err
    assert main(["status"]) == 2
    assert capsys.readouterr().out.splitlines()[0].startswith("RUN")


@pytest.mark.parametrize("how", ["positional", "--run", "run file"])
def test_status_shows_the_run_it_is_told(two_runs, capsys, how):
    """Its nodes are not there: they show as UNPROVEN (asked nothing), at the chosen run's addresses."""
    path = two_runs[1]
    chosen = {"positional": [path.stem], "--run": ["--run", path.stem], "run file": [str(path)]}[how]
    assert main(["status", *chosen, "--json", "--interval", "0", "--timeout", "0.5"]) == 1
    nodes = json.loads(capsys.readouterr().out)
    assert [n["address"] for n in nodes] == SECOND["ps"] + SECOND["worker"]
    assert {n["health"] for n in nodes[:2]} == {"UNPROVEN"}  # the run's secret was used: nodes must prove it


def test_a_missing_run_is_a_clear_error(two_runs):
    with pytest.raises(ConfigError, match="no run 'run-1-ab' of yours"):
        main(["status", "--run", "run-1-ab", "--interval", "0"])


# ---- STEP: the run's step ------------------------------------------------------------------------------
def test_the_run_resumed_from_the_oldest_checkpoint_the_ps_restored():
    assert resumed_from([None, None]) == (False, None)  # no PS answered: unknown
    assert resumed_from([{"restored_from": None}, None]) == (True, None)  # a fresh start
    ckpt = "ckpt-000000300"
    assert resumed_from([{"restored_from": ckpt}, {"restored_from": ckpt}]) == (True, ckpt)
    # ps 1 restored alone later (partial recovery): the run did not jump to its checkpoint's step
    assert resumed_from([{"restored_from": ckpt}, {"restored_from": "ckpt-000000900"}]) == (True, ckpt)
    assert resumed_from([{"restored_from": None}, {"restored_from": "ckpt-000000900"}]) == (True, None)
    assert run_step(ckpt, 25) == 325 and run_step(None, 25) == 25


def test_a_workers_step_is_the_runs_not_the_count_since_its_start():
    view = {"states": {"0": "training", "1": "finished"}, "steps": {"0": 40, "1": 7}}
    workers = [NodeStatus("worker", 0, "a"), NodeStatus("worker", 1, "b")]
    _fill_workers(workers, view, (True, "ckpt-000001000"))
    assert [(w.step, w.state, w.resumed_from) for w in workers] == [
        (1040, "training", "ckpt-000001000"),
        (1007, "finished", "ckpt-000001000"),
    ]
    _fill_workers(workers, view, (False, None))  # no PS said what the run resumed from
    assert [w.step for w in workers] == [None, None]
    _fill_workers(workers, view, (True, None))
    assert [w.step for w in workers] == [40, 7]
    assert started_at(2**22 + 17) is None  # no such process


def test_status_over_real_nodes_shows_the_runs_step_after_a_resume(tmp_path):
    """A PS restored from a checkpoint at step 300 and a coordinator whose workers reported 40 and 7
    steps since they started: STEP is 340 and 307 (the run's step), not 40 and 7."""
    trained = Shard(0)
    trained.register("g", {"name": "sgd", "hyper": {"lr": 0.1}}, {"w": np.ones(4, np.float32)})
    store = CheckpointStore(str(tmp_path))
    name = checkpoint_name(300)
    entry = shard_file.write(store, name, trained, TableStore(0)).__dict__
    store.commit(name, {"step": 300, "num_shards": 1, "shards": [entry]})
    coordinator = Coordinator(2)
    for worker, steps in ((0, 40), (1, 7)):
        coordinator.join(worker)
        coordinator.heartbeat(worker, steps)
    servers = [
        GrpcServer(ShardService(Shard(0, restore=RestoreSource(store, name))), "127.0.0.1:0", 1 << 20, 2),
        GrpcServer(CoordinatorService(coordinator), "127.0.0.1:0", 1 << 20, 2, COORDINATOR),
    ]
    try:
        ps_address, coordinator_address = (f"127.0.0.1:{server.start()}" for server in servers)
        cluster = ClusterSpec(ps=(ps_address,), worker=(coordinator_address, "127.0.0.1:1"))
        nodes = cluster_status(cluster, interval=0, timeout=2)
    finally:
        for server in servers:
            server.stop(0.5)
    assert [(n.role, n.resumed_from) for n in nodes] == [("ps", name), ("worker", name), ("worker", name)]
    assert [n.step for n in nodes[1:]] == [340, 307]
