"""Operations surface of real nodes: grpc.health.v1 transitions, the SIGTERM drain, every node's
Prometheus endpoint (read with prometheus_client's own parser), and `paramserver status`."""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tests.conftest import ROOT, Procs
from tests.ports import free_port
from tests.prometheus_samples import scrape, value

from paramserver.transport.health import check

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "train_then_wait.py")
STEPS = 10
BOUND_S = 120  # generous: a loaded 2-core machine starts torch slowly
METRICS_LINE = re.compile(r"Prometheus metrics on http://([^/]+)/metrics")


class Lines:
    """A child's output lines, read on a thread, waited for by pattern (never by time)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(proc,), name="test-lines", daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + BOUND_S
        for line in self.seen:
            if match := re.search(pattern, line):
                return match
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(self.seen)}")


def node(procs: Procs, *args: str, stdin=None) -> tuple[subprocess.Popen, Lines]:
    proc = procs.start([sys.executable, "-m", "paramserver", "--log-level", "INFO", "node", *args],
                       stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, Lines(proc)


@pytest.mark.cluster
def test_sigterm_drains_a_ps_node_while_a_health_watch_sees_it(procs):
    proc, lines = node(procs, "--role", "ps", "--bind", "127.0.0.1:0", "--drain-grace", "3")
    address = lines.wait_for(r"PARAMSERVER_READY ps 0 (\S+)").group(1)
    seen: queue.Queue = queue.Queue()

    def watch() -> None:
        with grpc.insecure_channel(address) as channel:
            try:
                for reply in health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                                        timeout=BOUND_S):
                    seen.put(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
            except grpc.RpcError as exc:  # the server stopped: the watch ends
                seen.put(exc.code().name)
    watcher = threading.Thread(target=watch, name="test-health-watch", daemon=True)
    watcher.start()
    assert seen.get(timeout=BOUND_S) == "SERVING"
    proc.send_signal(signal.SIGTERM)
    assert seen.get(timeout=BOUND_S) == "NOT_SERVING"  # health goes first, before the servers stop
    assert proc.wait(BOUND_S) == 0
    watcher.join(BOUND_S)
    assert seen.get(timeout=BOUND_S) in ("UNAVAILABLE", "CANCELLED")
    drained = lines.wait_for(r"ps 0 drained in ([0-9.]+)s")
    assert float(drained.group(1)) <= 3 + 1.5  # within the grace period (the open watch holds it to the end)
    lines.wait_for(r"ps 0 draining: health NOT_SERVING")


# ---- a small live cluster: metrics and status -------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """1 PS and 2 workers (worker 0 hosts the coordinator), each with a metrics endpoint on a free port,
    the workers trained STEPS steps each and wait on stdin."""
    procs = Procs()
    try:
        ps, ps_lines = node(procs, "--role", "ps", "--bind", "127.0.0.1:0", "--metrics-port", "0")
        ps_address = ps_lines.wait_for(r"PARAMSERVER_READY ps 0 (\S+)").group(1)
        spec = {"ps": [ps_address], "worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
        path = tmp_path_factory.mktemp("ops") / "cluster.json"
        path.write_text(json.dumps(spec))
        workers = [node(procs, "--cluster", str(path), "--role", "worker", "--index", str(i), "--metrics-port", "0",
                        SCRIPT, "--steps", str(STEPS), stdin=subprocess.PIPE) for i in range(2)]
        for _, worker_lines in workers:
            worker_lines.wait_for(r"^TRAINED")
        metrics = {"ps": ps_lines.wait_for(METRICS_LINE.pattern).group(1),
                   "chief": workers[0][1].wait_for(METRICS_LINE.pattern).group(1),
                   "worker": workers[1][1].wait_for(METRICS_LINE.pattern).group(1)}
        yield {"spec": spec, "path": path, "metrics": metrics, "ps": ps, "workers": workers, "procs": procs}
        for worker, _ in workers:  # all at once: worker 0 keeps the coordinator up until worker 1 is done
            worker.stdin.write("\n")
            worker.stdin.close()
        assert [w.wait(BOUND_S) for w, _ in workers] == [0, 0]
        ps.send_signal(signal.SIGTERM)
        assert ps.wait(BOUND_S) == 0
    finally:
        procs.cleanup()


def wait_for_heartbeats(chief_metrics: str) -> dict:
    """The chief's metrics once the coordinator heard every worker's last step (heartbeats carry it)."""
    deadline = time.monotonic() + BOUND_S
    while True:
        samples = scrape(chief_metrics)
        if value(samples, "paramserver_global_step") == 2 * STEPS or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)  # polling a condition; the bound above decides nothing by itself


@pytest.mark.cluster
def test_every_node_serves_prometheus_metrics(cluster):
    ps = scrape(cluster["metrics"]["ps"])
    assert value(ps, "paramserver_pushes_total", shard="0") == 2 * STEPS
    assert value(ps, "paramserver_updates_applied_total", shard="0") == 2 * STEPS  # async: every push applied
    assert value(ps, "paramserver_calls_total", service="paramserver.Shard", method="PushPull", code="OK") == 2 * STEPS
    assert value(ps, "paramserver_call_duration_seconds_count", service="paramserver.Shard",
                 method="PushPull") == 2 * STEPS
    assert value(ps, "paramserver_request_bytes_total", service="paramserver.Shard", method="PushPull") > 0
    assert value(ps, "paramserver_reply_bytes_total", service="paramserver.Shard", method="PushPull") > 0
    assert value(ps, "paramserver_pushes_dropped_late_total", shard="0") == 0
    assert 10 * 2**20 < value(ps, "process_resident_memory_bytes") < 2**31

    chief = wait_for_heartbeats(cluster["metrics"]["chief"])
    assert value(chief, "paramserver_global_step") == 2 * STEPS
    assert value(chief, "paramserver_workers", state="training") + value(chief, "paramserver_workers",
                                                                         state="finished") == 2
    assert value(chief, "paramserver_calls_total", service="paramserver.Coordinator", method="Join", code="OK") >= 2
    assert value(chief, "paramserver_worker_step", worker="0") == STEPS
    assert value(chief, "process_resident_memory_bytes") > 50 * 2**20  # torch is loaded

    worker = scrape(cluster["metrics"]["worker"])
    assert value(worker, "paramserver_worker_step", worker="1") == STEPS
    assert not any(name.startswith("paramserver_calls") for name, _ in worker)  # it serves no calls
    assert value(worker, "process_resident_memory_bytes") > 50 * 2**20


@pytest.mark.cluster
def test_every_node_serves_health(cluster):
    for address in (*cluster["spec"]["ps"], *cluster["spec"]["worker"]):
        assert check(address, 30) == "SERVING", address
    assert check(cluster["spec"]["worker"][0], 30, "paramserver.Coordinator") == "SERVING"


@pytest.mark.cluster
def test_status_prints_every_node(cluster, procs):
    wait_for_heartbeats(cluster["metrics"]["chief"])
    cli = [sys.executable, "-m", "paramserver", "status", str(cluster["path"]), "--interval", "0.2"]
    result = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=BOUND_S, env=procs.env())
    assert result.returncode == 0, result.stderr
    nodes = {(n["role"], n["index"]): n for n in json.loads(result.stdout)}
    assert set(nodes) == {("ps", 0), ("worker", 0), ("worker", 1)}
    assert all(n["health"] == "SERVING" for n in nodes.values())
    assert nodes[("ps", 0)]["step"] == 2 * STEPS and nodes[("ps", 0)]["rss_bytes"] > 10 * 2**20
    assert nodes[("ps", 0)]["pushes_per_s"] == 0.0  # the workers wait: no pushes between the samples
    assert [nodes[("worker", i)]["step"] for i in (0, 1)] == [STEPS, STEPS]
    table = subprocess.run(cli, capture_output=True, text=True, timeout=BOUND_S, env=procs.env()).stdout
    assert table.splitlines()[0].split()[:4] == ["ROLE", "INDEX", "ADDRESS", "HEALTH"]
    assert len(table.splitlines()) == 4 and "MiB" in table


@pytest.mark.cluster
def test_status_shows_an_unreachable_node_and_says_so_in_its_exit_code(tmp_path, procs):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"ps": [f"127.0.0.1:{free_port()}"], "worker": [f"127.0.0.1:{free_port()}"]}))
    result = subprocess.run([sys.executable, "-m", "paramserver", "status", str(path), "--json", "--timeout", "1",
                             "--interval", "0"], capture_output=True, text=True, timeout=BOUND_S, env=procs.env())
    assert result.returncode == 1
    assert [n["health"] for n in json.loads(result.stdout)] == ["UNREACHABLE", "UNREACHABLE"]


@pytest.mark.cluster
def test_status_health_and_shutdown_without_a_cluster_find_the_local_run(tmp_path, procs):
    env = procs.env(PARAMSERVER_RUN_DIR=str(tmp_path / "runs"))
    cli = [sys.executable, "-m", "paramserver"]
    empty = subprocess.run([*cli, "status"], capture_output=True, text=True, timeout=BOUND_S, env=env)
    assert empty.returncode == 2 and "start `paramserver run` on this machine" in empty.stderr
    script = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")
    run = procs.start([*cli, "run", "--workers", "2", "--progress-every", "0.2", script, "--", "--steps", "0"],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    path = None
    for line in run.stdout:
        found = re.match(r"\[run\] cluster file: (\S+) \(`paramserver status` finds it\)", line)
        path = found[1] if found else path
        if line.startswith("[run] steps="):
            break
    assert path is not None and path.startswith(str(tmp_path / "runs"))
    ps_address = json.loads(open(path).read())["cluster"]["ps"][0]
    status = subprocess.run([*cli, "status", "--json", "--interval", "0.2"], capture_output=True, text=True,
                            timeout=BOUND_S, env=env)
    assert status.stdout, status.stderr  # (a worker may still be joining: exit code 1)
    first = json.loads(status.stdout)[0]
    assert (first["role"], first["address"], first["health"]) == ("ps", ps_address, "SERVING")
    health = subprocess.run([*cli, "health"], capture_output=True, text=True, timeout=BOUND_S, env=env)
    assert f"{ps_address} SERVING" in health.stdout, health.stdout + health.stderr
    stop = subprocess.run([*cli, "shutdown", "--reason", "test"], capture_output=True, text=True, timeout=BOUND_S,
                          env=env)
    assert stop.returncode == 0 and json.loads(stop.stdout)["draining"], stop.stdout + stop.stderr
    run.communicate(timeout=60)
    assert not (tmp_path / "runs" / os.path.basename(path)).exists()  # deleted when the run stopped
    assert procs.leftovers() == []
