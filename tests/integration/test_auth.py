"""Tokens and roles on a real PS process (gRPC and the tensor stream) and a real coordinator server:
refused calls are UNAUTHENTICATED / PERMISSION_DENIED, audited, and change nothing."""

import json
import socket
import struct
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from tests.conftest import ROOT
from tests.reference import batches, max_relative_error, mlp, train, twin

import paramserver as ps
from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task
from paramserver.base.errors import PermissionDeniedError, UnauthenticatedError, UnavailableError
from paramserver.coordinator.coordinator_service import SERVICE as COORDINATOR
from paramserver.node.coordinator_host import CoordinatorHost
from paramserver.security.tokens import write_tokens
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.transport.stream_client import StreamClient
from paramserver.wire import codec

pytestmark = pytest.mark.cluster  # real PS, coordinator and worker processes

SMALL = str(ROOT / "tests" / "integration" / "scripts" / "train_small.py")

NODES = ["ps-0", "worker-0", "worker-1", "admin"]
TRANSPORTS = {"grpc": dict(use_stream=False), "tcp": dict(use_stream=True, use_shared_memory=False),
              "shm": dict(use_stream=True, use_shared_memory=True)}


class Secured:
    """A PS process that checks tokens and writes an audit file; tokens made with write_tokens."""

    def __init__(self, procs, tmp_path: Path) -> None:
        self.dir = tmp_path / "tokens"
        write_tokens(self.dir, NODES)
        self.audit = tmp_path / "ps-audit.jsonl"
        options = {"auth_tokens": str(self.dir / "tokens.json"), "audit_log": str(self.audit)}
        _, self.address = procs.start_ps(PARAMSERVER_OPTIONS=json.dumps(options))
        self.channels: list[GrpcChannel] = []

    def token(self, node: str) -> str:
        return (self.dir / f"{node}.token").read_text().strip()

    def channel(self, node: str | None, transport: str = "grpc", token: str | None = None) -> GrpcChannel:
        channel = GrpcChannel(self.address, 1 << 24, token=token or (self.token(node) if node else None),
                              **TRANSPORTS[transport])
        self.channels.append(channel)
        return channel

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.audit.read_text().splitlines()]

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


@pytest.fixture
def secured(procs, tmp_path):
    node = Secured(procs, tmp_path)
    yield node
    node.close()


def call(channel, method, meta, tensors=()):
    return codec.decode(channel.call(method, codec.encode(meta, tensors), 10).wait(10))


def register(channel):
    initial = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.zeros(2, np.float32)}
    call(channel, "Register", {"group": "g", "optimizer": {"name": "sgd", "hyper": {"lr": 1}}, "worker": 0},
         initial.items())


def pull(channel):
    frame = call(channel, "PushPull", {"pull": ["w", "b"], "worker": 0})
    return frame.meta["version"], {name: array.copy() for name, array in frame.tensors.items()}


def raw_stream(secured, token, shared_memory=False):
    """A tensor stream to the PS without a gRPC Hello first (which a bad token could not pass)."""
    good = secured.channel("worker-0")
    good.wait_ready(20)
    port = call(good, "Hello", {}).meta["stream_port"]
    return StreamClient("127.0.0.1", port, 1 << 24, secured.address, shared_memory, token=token)


PUSH = ({"worker": 0}, [("b", np.ones(2, np.float32))])


def test_refused_calls_are_audited_and_change_nothing(secured):
    admin = secured.channel("admin")
    admin.wait_ready(20)
    register(admin)
    before = pull(admin)
    refusals = []  # (what, who, code) expected in the audit file

    # no token, a wrong token: UNAUTHENTICATED on gRPC and on the stream (inline and shared memory)
    for token in (None, "not-a-known-token"):
        with pytest.raises(UnauthenticatedError):
            call(secured.channel(None, token=token), "PushPull", *PUSH)
        refusals.append(("PushPull", "anonymous", "UNAUTHENTICATED"))
    stream = raw_stream(secured, None, shared_memory=True)
    with pytest.raises(UnauthenticatedError):
        codec.decode(stream.call("PushPull", codec.encode(*PUSH), 10).wait(10))
    refusals.append(("PushPull", "anonymous", "UNAUTHENTICATED"))
    # large enough for a segment: the attach is refused, and the frame, sent inline, is never read (the
    # connection is closed; its refusal may be cut off with it)
    big = [("b", np.ones(2, np.float32)), ("pad", np.zeros(1 << 17, np.float32))]
    with pytest.raises((UnauthenticatedError, UnavailableError)):
        codec.decode(stream.call("PushPull", codec.encode(PUSH[0], big), 10).wait(10))
    stream.close()
    # both refusals made before a token are audited too: the attach, and the message not read
    refusals += [("StreamAttach", "anonymous", "UNAUTHENTICATED"), ("PushPull", "anonymous", "UNAUTHENTICATED")]
    wrong = raw_stream(secured, "not-a-known-token")
    with pytest.raises(UnauthenticatedError, match="not known"):
        wrong.call("PushPull", codec.encode(*PUSH), 10).wait(10)
    wrong.close()
    refusals.append(("StreamAuth", "anonymous", "UNAUTHENTICATED"))

    # a worker token: no checkpoints, no mode switch, not as another worker, no Forget
    for transport in ("grpc", "tcp"):
        worker1 = secured.channel("worker-1", transport)
        worker1.wait_ready(20)
        denied = [("Checkpoint", {"dir": "/tmp", "name": "ckpt-000000001"}, ()),
                  ("SetMode", {"consistency": {"mode": "sync", "workers": 2, "backups": 0, "staleness": 0}}, ()),
                  ("PushPull", *PUSH), ("Leave", {"worker": 0}, ()),
                  ("Register", {"group": "h", "optimizer": {"name": "sgd", "hyper": {"lr": 1}}, "worker": 0},
                   [("v", np.ones(2, np.float32))]),
                  ("Leave", {"worker": 1, "gone": "forged"}, ())]
        for method, meta, tensors in denied:
            if transport == "tcp" and method == "Checkpoint":
                continue  # Checkpoint travels on gRPC only
            with pytest.raises(PermissionDeniedError):
                call(worker1, method, meta, tensors)
            refusals.append(("Forget" if "gone" in meta else method, "worker-1", "PERMISSION_DENIED"))

    after = pull(admin)
    assert after[0] == before[0]
    for name in before[1]:
        np.testing.assert_array_equal(after[1][name], before[1][name])
    assert set(call(admin, "Hello", {}).meta["tables"]) == set()

    records = secured.records()
    for record in records:
        assert set(record) == {"time", "node", "who", "peer", "what", "outcome", "detail"}
        assert record["node"] == "ps-0" and record["time"].endswith("+00:00")
    refused = [(r["what"], r["who"], r["outcome"]) for r in records if r["outcome"] != "ok"]
    assert sorted(refused) == sorted(refusals)
    assert all(r["detail"].get("message") for r in records if r["outcome"] != "ok")


def test_the_worker_token_acts_as_its_own_worker(secured):
    worker1 = secured.channel("worker-1", "shm")
    worker1.wait_ready(20)
    size = 1 << 15  # 128 KiB: through the shared-memory segment, attached once the token was accepted
    call(worker1, "Register", {"group": "g", "optimizer": {"name": "sgd", "hyper": {"lr": 1}}, "worker": 1},
         [("b", np.zeros(size, np.float32))])
    reply = call(worker1, "PushPull", {"worker": 1}, [("b", np.ones(size, np.float32))])
    np.testing.assert_array_equal(reply.tensors["b"], np.full(size, -1, np.float32))
    assert worker1._stream.shared_memory  # the attach was not refused
    call(worker1, "Leave", {"worker": 1})
    chief = secured.channel("worker-0")  # worker-0 is the chief when no chief-* is listed
    chief.wait_ready(20)
    call(chief, "Leave", {"worker": 1, "gone": "missed heartbeats"})
    forget = [r for r in secured.records() if r["what"] == "Forget"]
    assert [(r["who"], r["outcome"], r["detail"]["worker"]) for r in forget] == [("worker-0", "ok", 1)]


def test_a_run_with_tokens_trains_and_the_coordinator_audits_joins(secured, fresh_context, tmp_path):
    options = Options(connect_timeout_s=20, token_file=str(secured.dir / "worker-0.token"),
                      auth_tokens=str(secured.dir / "tokens.json"), audit_log=str(tmp_path / "coordinator.jsonl"))
    cluster = ClusterSpec(ps=(secured.address,), worker=("127.0.0.1:0",))
    ps.init(NodeConfig(cluster, Task("worker", 0), options))
    reference = mlp()
    model = twin(reference)
    data = batches(20)
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), data)
    train(model, ps.optim.SGD(model.parameters(), lr=0.1), data)
    assert max_relative_error(model, reference) < 1e-5
    joins = [json.loads(line) for line in (tmp_path / "coordinator.jsonl").read_text().splitlines()]
    assert [(r["what"], r["who"], r["outcome"]) for r in joins][:1] == [("Join", "worker-0", "ok")]
    assert not [r for r in secured.records() if r["outcome"] != "ok"]


@pytest.fixture
def coordinator(secured, tmp_path):
    options = Options(auth_tokens=str(secured.dir / "tokens.json"), audit_log=str(tmp_path / "coordinator.jsonl"))
    host = CoordinatorHost(2, "127.0.0.1:0", options)
    address = host.start()
    host.wait_ready(10)
    channels = []

    def channel(node, token=None):
        made = GrpcChannel(address, 1 << 20, use_stream=False, service_name=COORDINATOR,
                           token=token or secured.token(node))
        channels.append(made)
        return made
    yield host, channel, tmp_path / "coordinator.jsonl"
    for made in channels:
        made.close()
    host.stop(1.0)


def test_the_coordinator_refuses_unknown_nodes_and_other_workers(coordinator):
    host, channel, audit = coordinator
    worker1 = channel("worker-1")
    call(worker1, "Join", {"worker": 1})
    before = host.coordinator.view()
    cases = [(channel(None, token="forged"), "Join", {"worker": 0}, UnauthenticatedError),
             (worker1, "Join", {"worker": 0}, PermissionDeniedError),
             (worker1, "Heartbeat", {"worker": 0, "step": 10**12}, PermissionDeniedError),
             (worker1, "Leave", {"worker": 0}, PermissionDeniedError),
             (worker1, "RequestCheckpoint", {"worker": 1}, PermissionDeniedError)]
    for made, method, meta, error in cases:
        with pytest.raises(error):
            call(made, method, meta)
    assert host.coordinator.view() == before
    call(channel("worker-0"), "RequestCheckpoint", {"worker": 0})  # the chief's timer
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(r["what"], r["who"], r["outcome"]) for r in records] == [
        ("Join", "worker-1", "ok"), ("Join", "anonymous", "UNAUTHENTICATED"),
        ("Join", "worker-1", "PERMISSION_DENIED"), ("Heartbeat", "worker-1", "PERMISSION_DENIED"),
        ("Leave", "worker-1", "PERMISSION_DENIED"), ("RequestCheckpoint", "worker-1", "PERMISSION_DENIED"),
        ("RequestCheckpoint", "worker-0", "ok")]
    assert all(r["node"] == "coordinator" for r in records)


def test_paramserver_run_with_tokens_switches_modes_and_checkpoints_with_each_nodes_own_token(procs, tmp_path):
    """Every node holds only its own token: the chief's scheduled mode switch, its checkpoints and
    everyone's joins are accepted, and nothing is refused."""
    audit, tokens = tmp_path / "audit.jsonl", tmp_path / "tokens"
    proc = procs.start([sys.executable, "-m", "paramserver", "run", "--workers", "2", "--tokens", str(tokens),
                        "--audit-log", str(audit), "--mode-schedule", "sync@5", "--checkpoint-dir",
                        str(tmp_path / "ckpt"), "--progress-every", "0", SMALL, "--", "--steps", "10"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 20
    assert {path.name for path in tokens.iterdir()} == {"tokens.json", "ps-0.token", "worker-0.token",
                                                        "worker-1.token", "admin.token"}
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [r for r in records if r["outcome"] != "ok"] == []
    seen = {(r["node"], r["what"], r["who"]) for r in records}
    assert {("coordinator", "Join", "worker-0"), ("coordinator", "Join", "worker-1"),
            ("ps-0", "SetMode", "worker-0"), ("ps-0", "Checkpoint", "worker-0")} <= seen


def test_the_stream_reads_nothing_large_before_a_token(secured):
    good = secured.channel("admin")
    good.wait_ready(20)
    port = call(good, "Hello", {}).meta["stream_port"]
    for kind, declared in ((5, 1 << 30), (0, 1 << 30)):  # an auth message, a request: 1 GiB declared, not sent
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(struct.pack("<4sBBHQ", b"PSTS", kind, 0, 2, declared))
            _, _, status, _, size = struct.unpack("<4sBBHQ", sock.recv(16, socket.MSG_WAITALL))
            assert status == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert b"token" in sock.recv(size, socket.MSG_WAITALL)
            assert sock.recv(16) == b""  # closed: nothing more is read from it
    assert call(good, "Hello", {}).meta["version"] == 0  # the PS serves on
