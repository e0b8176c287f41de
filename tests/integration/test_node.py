"""`paramserver node`: one node per process, from TF_CONFIG or a cluster file, as on several hosts."""

import json
import subprocess
import sys

import pytest
from tests.conftest import ROOT
from tests.ports import free_port

from paramserver.launch.threads import PASSIVE_WAIT_ENV
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.wire import codec

pytestmark = pytest.mark.cluster  # `paramserver node` processes

SMALL = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")


def seed_cluster() -> dict:
    """The seed article's cluster shape: one PS, two workers, no chief (on free local ports)."""
    return {"ps": [f"localhost:{free_port()}"], "worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}


def node(procs, env, *args):
    return procs.start([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "node", *args],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def shard_counters(address: str) -> dict:
    """The PS's counters (version, sync step, mode, pushes), read through its Hello."""
    channel = GrpcChannel(address, 1 << 20, use_stream=False)
    try:
        return codec.decode(channel.call("Hello", codec.encode({}), 10).wait(10)).meta
    finally:
        channel.close()


def applied_pushes(address: str) -> int:
    """The PS's version: pushes applied so far."""
    return shard_counters(address)["version"]


def test_seed_cluster_from_tf_config(procs):
    cluster = seed_cluster()

    def tf_config(role, index):
        env = procs.env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": role, "index": index}}))
        return {name: value for name, value in env.items() if name not in PASSIVE_WAIT_ENV}
    ps_node = node(procs, tf_config("ps", 0))
    workers = [node(procs, tf_config("worker", i), SMALL, "--steps", "30") for i in range(2)]
    outputs = [w.communicate(timeout=180)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    assert "worker 0/2 done" in outputs[0] and "worker 1/2 done" in outputs[1]
    # a node started by hand gets the passive OpenMP wait too, before its script imports torch
    assert all("OMP_WAIT_POLICY=PASSIVE" in out for out in outputs), outputs
    assert ps_node.poll() is None  # a PS serves until it is stopped
    assert applied_pushes(cluster["ps"][0]) == 60
    ps_node.terminate()
    assert ps_node.wait(30) == 0


def test_cluster_file_with_role_and_index_flags(procs, tmp_path):
    path = tmp_path / "cluster.json"
    cluster = seed_cluster()
    path.write_text(json.dumps(cluster))
    ps_node = node(procs, procs.env(), "--cluster", str(path), "--role", "ps", "--index", "0")
    workers = [node(procs, procs.env(), "--cluster", str(path), "--role", "worker", "--index", str(i), SMALL,
                    "--steps", "30") for i in range(2)]
    outputs = [w.communicate(timeout=180)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    assert applied_pushes(cluster["ps"][0]) == 60
    ps_node.terminate()
    assert ps_node.wait(30) == 0


def test_plain_python_script_with_tf_config_runs_unchanged(procs):
    """The same script, started with plain `python` on each host, finds its role in TF_CONFIG."""
    cluster = {"ps": [f"127.0.0.1:{free_port()}"], "worker": [f"127.0.0.1:{free_port()}"]}

    def env(role):
        return procs.env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": role, "index": 0}}))
    ps_proc = procs.start([sys.executable, SMALL], env=env("ps"), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    worker = procs.start([sys.executable, SMALL, "--steps", "10"], env=env("worker"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    out, _ = worker.communicate(timeout=180)
    assert worker.returncode == 0, out
    assert "worker 0/1 done" in out
    ps_proc.terminate()
    assert ps_proc.wait(30) == 0


@pytest.mark.parametrize("args, fragment", [
    (["--role", "ps"], "needs TF_CONFIG, --cluster, or --bind"),
    (["--cluster", "/nonexistent.json", "--role", "ps"], "cannot read cluster file"),
    ([SMALL], "a worker node needs TF_CONFIG"),
])
def test_node_configuration_errors_are_clear(procs, args, fragment):
    proc = node(procs, procs.env(), *args)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and fragment in out


def test_node_flags_combine_with_tf_config(procs):
    cluster = seed_cluster()

    def tf_config(role, index):
        return procs.env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": role, "index": index}}))
    ps_node = node(procs, tf_config("ps", 0))
    workers = [node(procs, tf_config("worker", i), "--mode", "sync", SMALL, "--steps", "30") for i in range(2)]
    outputs = [w.communicate(timeout=180)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    counters = shard_counters(cluster["ps"][0])
    assert counters["mode"] == "sync"
    assert (counters["sync_step"], counters["version"], counters["pushes"]) == (30, 30, 60)  # one update a step
    ps_node.terminate()
    assert ps_node.wait(30) == 0


def test_nodes_started_with_different_modes_are_refused_at_join(procs):
    cluster = seed_cluster()

    def tf_config(role, index):
        return procs.env(TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": role, "index": index}}))
    node(procs, tf_config("ps", 0))
    modes = [["--mode", "sync"], []]  # worker 1 forgot the flag: async
    workers = [node(procs, tf_config("worker", i), *modes[i], SMALL, "--steps", "30") for i in range(2)]
    outputs = [w.communicate(timeout=180)[0] for w in workers]
    codes = [w.returncode for w in workers]
    assert sorted(codes) == [0, 2], outputs  # the one that joined second is refused; the other trains on
    refused = outputs[codes.index(2)]
    assert "joined with mode" in refused and "start every node with the same --mode" in refused, refused


def test_a_ps_bound_to_every_interface_logs_where_it_listens_and_its_cluster_address(procs, tmp_path):
    port = free_port()
    listed = f"ps-host.example:{port}"  # not this machine's loopback: the PS listens on every interface
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"ps": [listed], "worker": [f"localhost:{free_port()}"]}))
    proc = procs.start([sys.executable, "-m", "paramserver", "node", "--cluster", str(path), "--role", "ps"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=procs.env())
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("PARAMSERVER_READY"):
            break
    proc.terminate()
    proc.communicate(timeout=30)
    said = [line for line in seen if "ps 0 serving on" in line]
    assert said and f"ps 0 serving on 0.0.0.0:{port}, cluster address {listed} (tensor stream" in said[0], seen
