"""Run files with real processes: `paramserver run` writes none into a runs directory another user
could write; `status` and `shutdown` given no cluster send no token to a listener a swapped run file
names, and `shutdown` drains no PS of another launcher (launch/local/run_files.py, docs/security.md)."""

import json
import os
import re
import secrets
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import pytest
from tests.conftest import ROOT

from paramserver.transport.health import check

pytestmark = pytest.mark.cluster
BOUND_S = 120  # generous: a loaded 2-core machine starts torch slowly
CLI = [sys.executable, "-m", "paramserver"]
SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")


def start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (after the command name, which may hold spaces)."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rpartition(")")[2].split()[19])


class Listener:
    """A gRPC server that answers every method of every service with empty bytes and records each
    call's method and metadata: what a squatter on a node's address would see."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(4, thread_name_prefix="squatter"))
        self.server.add_generic_rpc_handlers((self,))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def service(self, details):
        with self._lock:
            self.calls.append((details.method, dict(details.invocation_metadata)))
        return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")

    def tokens(self) -> list[str]:
        with self._lock:
            return [meta["authorization"] for _, meta in self.calls if "authorization" in meta]

    def methods(self) -> set[str]:
        with self._lock:
            return {method for method, _ in self.calls}


@pytest.fixture
def listener():
    squatter = Listener()
    yield squatter
    squatter.server.stop(0)


def swapped_runs(folder, cluster, launcher_start=None):
    """A runs directory of this user holding what a swapped run file looks like to every reader: one in
    the old name form (run-<pid>.json), and one of the new form whose files are this user's, whose launcher
    (this process) is alive, and whose secret is not the one the listed nodes hold."""
    folder.mkdir(mode=0o700)
    pid = os.getpid()
    (folder / f"run-{pid}.json").write_text(json.dumps({"cluster": cluster}))
    stem = folder / f"run-{pid}-5eed5eed"
    started = start_time(pid) if launcher_start is None else launcher_start
    for path, text in (
        (stem.with_suffix(".json"), json.dumps({"cluster": cluster, "launcher": {"pid": pid, "start_time": started}})),
        (stem.with_suffix(".secret"), secrets.token_hex(32)),
    ):
        path.touch(mode=0o600)
        path.write_text(text)


def test_run_writes_no_run_file_into_a_runs_directory_anyone_may_write(tmp_path, procs):
    folder = tmp_path / "runs"
    folder.mkdir()
    folder.chmod(0o777)
    env = procs.env(PARAMSERVER_RUN_DIR=str(folder))
    run = procs.start(
        [*CLI, "run", "--workers", "1", "--progress-every", "0", SCRIPT, "--", "--steps", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    out, _ = run.communicate(timeout=BOUND_S)
    assert run.returncode == 0, out
    assert re.search(
        r"\[run\] no run file: runs directory \S+ may be written by anyone \(mode 0777\).*"
        r"set PARAMSERVER_RUN_DIR to a directory of your own",
        out,
    ), out
    assert "cluster file:" not in out, out
    assert list(folder.iterdir()) == []


def test_status_refuses_a_runs_directory_of_another_user(tmp_path, procs):
    folder = tmp_path / "runs"
    swapped_runs(folder, {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
    os.chown(folder, 65534, -1)
    env = procs.env(PARAMSERVER_RUN_DIR=str(folder))
    status = subprocess.run(
        [*CLI, "status", "--interval", "0", "--timeout", "1"], capture_output=True, text=True, timeout=BOUND_S, env=env
    )
    assert status.returncode == 2, status.stdout + status.stderr
    assert f"runs directory {folder} is owned by uid 65534, not by you" in status.stderr
    assert "PARAMSERVER_RUN_DIR" in status.stderr


def test_status_and_shutdown_send_no_token_to_a_listener_a_swapped_run_file_names(tmp_path, procs, listener):
    folder = tmp_path / "runs"
    swapped_runs(folder, {"ps": [listener.address], "worker": [listener.address]})
    token = tmp_path / "admin.token"
    token.write_text("t-admin-do-not-leak\n")
    env = procs.env(PARAMSERVER_RUN_DIR=str(folder))
    status = subprocess.run(
        [*CLI, "status", "--json", "--interval", "0", "--timeout", "2", "--token-file", str(token)],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        env=env,
    )
    stop = subprocess.run(
        [*CLI, "shutdown", "--timeout", "2", "--token-file", str(token)],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        env=env,
    )
    said = status.stdout + status.stderr + stop.stdout + stop.stderr
    assert listener.tokens() == [], said
    assert not listener.methods() & {
        "/paramserver.Shard/Hello",
        "/paramserver.Shard/Shutdown",
        "/paramserver.Coordinator/Hello",
    }, said
    assert status.returncode == 1 and [n["health"] for n in json.loads(status.stdout)] == ["UNPROVEN"] * 2, said
    assert stop.returncode == 1 and "UNPROVEN" in json.loads(stop.stdout)["error"], said


def test_shutdown_without_a_cluster_drains_no_ps_of_another_launcher(tmp_path, procs):
    _, address = procs.start_ps()  # another job's PS: it holds no secret of this run
    cluster = {"ps": [address], "worker": ["127.0.0.1:1"]}
    env_for = lambda folder: procs.env(PARAMSERVER_RUN_DIR=str(folder))
    stale = tmp_path / "stale"  # the launcher's PID is alive, but started at another time: not the run's
    swapped_runs(stale, cluster, launcher_start=start_time(os.getpid()) + 1)
    stop = subprocess.run([*CLI, "shutdown"], capture_output=True, text=True, timeout=BOUND_S, env=env_for(stale))
    assert stop.returncode == 2 and "not trusted" in stop.stderr and "is not running" in stop.stderr, (
        stop.stdout + stop.stderr
    )
    assert check(address, 5) == "SERVING"
    squatted = tmp_path / "squatted"  # a run file of a live launcher of this user whose PS is not that run's
    swapped_runs(squatted, cluster)
    stop = subprocess.run([*CLI, "shutdown"], capture_output=True, text=True, timeout=BOUND_S, env=env_for(squatted))
    assert stop.returncode == 1 and "did not prove it is ps 0 of this run" in stop.stdout, stop.stdout + stop.stderr
    assert check(address, 5) == "SERVING"


def test_status_and_shutdown_with_tokens_reach_the_nodes_of_the_callers_own_run(tmp_path, procs):
    """The nodes of a real run with tokens prove themselves (Prove passes the token gate) and are then
    asked with the admin token."""
    folder, tokens = tmp_path / "runs", tmp_path / "tokens"
    env = procs.env(PARAMSERVER_RUN_DIR=str(folder))
    run = procs.start(
        [
            *CLI,
            "run",
            "--workers",
            "1",
            "--tokens",
            str(tokens),
            "--progress-every",
            "0.2",
            SCRIPT,
            "--",
            "--steps",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    seen = []
    for line in run.stdout:
        seen.append(line)
        if line.startswith("[run] steps="):
            break
    assert any("[run] cluster file:" in line for line in seen), "".join(seen)
    admin = ["--token-file", str(tokens / "admin.token")]
    status = subprocess.run(
        [*CLI, "status", "--json", "--interval", "0.2", *admin],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        env=env,
    )
    nodes = json.loads(status.stdout)
    assert nodes[0]["health"] == "SERVING" and nodes[0]["step"] > 0, status.stdout + status.stderr
    assert nodes[1]["health"] == "SERVING" and nodes[1]["state"] == "training", status.stdout
    stop = subprocess.run(
        [*CLI, "shutdown", "--reason", "test", *admin], capture_output=True, text=True, timeout=BOUND_S, env=env
    )
    assert stop.returncode == 0 and json.loads(stop.stdout)["draining"], stop.stdout + stop.stderr
    run.communicate(timeout=60)
    assert list(folder.iterdir()) == []  # the run file and the secret go with the run
