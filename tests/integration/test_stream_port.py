"""The tensor stream port cannot be taken away (transport/stream_slots.py, docs/security.md): accept
survives running out of file descriptors, and connections that never prove themselves (no token,
no first message) hold no slot a worker needs and are closed within seconds."""

import json
import random
import resource
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from paramserver.security.tokens import write_tokens
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.transport.stream_slots import HANDSHAKE_S, MAX_PENDING
from paramserver.wire import codec

pytestmark = pytest.mark.cluster  # real PS processes

PREFIX = struct.Struct("<4sBBHQ")
BOUND_S = 60  # generous bound for waits on events; never a verdict
HELLO = codec.encode({})


def start_ps(procs, tmp_path, nofile, **options):
    """A PS process whose open-file limit is `nofile` (soft, hard); its stderr goes to a file."""
    log = tmp_path / "ps.log"
    argv = [sys.executable, "-m", "paramserver", "--log-level", "INFO", "node", "--role", "ps", "--index", "0",
            "--bind", "127.0.0.1:0"]
    proc = procs.start(argv, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                       env=procs.env(PARAMSERVER_OPTIONS=json.dumps(options)),
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile))
    line = proc.stdout.readline()
    assert line.startswith("PARAMSERVER_READY"), (line, log.read_text())
    return proc, line.split()[-1], log


def worker(address, token=None):
    """A worker's channel (tensor stream over TCP) that registered a group and pushed once."""
    channel = GrpcChannel(address, 1 << 24, use_stream=True, use_shared_memory=False, token=token)
    channel.wait_ready(BOUND_S)
    meta = {"group": "g", "optimizer": {"name": "sgd", "hyper": {"lr": 1}}, "worker": 0}
    codec.decode(channel.call("Register", codec.encode(meta, [("b", np.zeros(2, np.float32))]), 20).wait(20))
    push = codec.encode({"pull": ["b"], "worker": 0}, [("b", np.ones(2, np.float32))])
    reply = codec.decode(channel.call("PushPull", push, 20).wait(20))
    assert channel._stream is not None and channel._stream._sock is not None  # it went over the stream
    return channel, reply.meta["version"]


def stream_port(channel):
    return codec.decode(channel.call("Hello", HELLO, 20).wait(20)).meta["stream_port"]


def audited(tmp_path, what=None):
    """The audit records (their outcomes, with `what`)."""
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    return records if what is None else [r["outcome"] for r in records if r["what"] == what]


def closed_by_peer(sock, timeout):
    """Whether the PS closes the connection within `timeout` seconds (after a refusal, if it sends one)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_the_stream_accepts_again_after_running_out_of_descriptors(procs, tmp_path):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    proc, address, log = start_ps(procs, tmp_path, (256, 256))
    channel, _ = worker(address)
    port = stream_port(channel)
    storm = []
    try:  # proven connections (each sends a Hello) until the PS is out of descriptors, and beyond
        for _ in range(400):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=2)
            except TimeoutError:  # the listen backlog is full too: the PS accepts nothing now
                break
            sock.sendall(PREFIX.pack(b"PSTS", 0, 0, 0, len(HELLO)) + HELLO)
            storm.append(sock)
            if rng.random() < 0.05:
                time.sleep(0.01)
        deadline = time.monotonic() + BOUND_S
        while "accept failed" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "accept failed" in log.read_text(), f"seed {seed}: the storm never ran the PS out of descriptors"
    finally:
        for sock in storm:
            sock.close()
    # descriptors free again: a new worker joins over the stream (before the fix, the accepting thread had ended)
    channel.close()
    again, version = worker(address)
    assert version == 2, f"seed {seed}"
    assert "accepting again" in log.read_text(), f"seed {seed}"
    assert proc.poll() is None, f"seed {seed}"
    again.close()


def test_a_ps_raises_its_open_file_limit_to_the_hard_limit(procs, tmp_path):
    proc, _, _ = start_ps(procs, tmp_path, (256, 4096))
    assert psutil.Process(proc.pid).rlimit(psutil.RLIMIT_NOFILE) == (4096, 4096)


@pytest.mark.parametrize("tokens", [False, True], ids=["no-tokens", "tokens"])
def test_idle_anonymous_connections_do_not_keep_a_restarted_worker_out(procs, tmp_path, tokens):
    options, token = {}, None
    if tokens:
        write_tokens(tmp_path / "tokens", ["worker-0"])
        options = {"auth_tokens": str(tmp_path / "tokens" / "tokens.json"), "audit_log": str(tmp_path / "audit.jsonl")}
        token = (tmp_path / "tokens" / "worker-0.token").read_text().strip()
    _, address, _ = start_ps(procs, tmp_path, (4096, 4096), **options)
    channel, _ = worker(address, token)
    port = stream_port(channel)
    channel.close()  # the worker dies
    idle = [socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) for _ in range(300)]
    try:
        started = time.monotonic()
        restarted, version = worker(address, token)  # the worker restarts: it joins, over the stream
        took = time.monotonic() - started
        print(f"the restarted worker joined in {took:.2f}s behind {len(idle)} idle connections")
        assert version == 2 and took < HANDSHAKE_S, f"the restarted worker took {took:.1f}s to join"
        restarted.close()
        # the idle ones hold nothing for long: those displaced at once, the rest once the handshake time passed
        waited = time.monotonic()
        closed = sum(closed_by_peer(sock, max(0.1, waited + HANDSHAKE_S + 5 - time.monotonic())) for sock in idle)
        assert closed == len(idle), f"{len(idle) - closed} idle connections still open after {HANDSHAKE_S}s"
    finally:
        for sock in idle:
            sock.close()
    if tokens:  # each audited once (a displaced connection's thread audits it just after it was shut)
        deadline = time.monotonic() + BOUND_S
        while len(handshakes := audited(tmp_path, "StreamHandshake")) < len(idle) and time.monotonic() < deadline:
            time.sleep(0.1)
        records = audited(tmp_path)
        counts = {outcome: handshakes.count(outcome) for outcome in set(handshakes)}
        assert len(handshakes) == len(idle), (counts, records[-3:])  # each closed once, and audited
        assert counts.get("RESOURCE_EXHAUSTED", 0) >= len(idle) - MAX_PENDING, (counts, records[-3:])
        assert counts.get("DEADLINE_EXCEEDED", 0) > 0
