"""Operator limits on a real PS process: idle connections, connection count, message size, port in use."""

import json
import socket
import struct
import subprocess
import sys

import grpc
import numpy as np
import psutil
import pytest

from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.wire import codec

PREFIX = struct.Struct("<4sBBHQ")
BOUND_S = 60  # generous bound for waits on events; never a verdict


def start(procs, bind="127.0.0.1:0", **options):
    return procs.start_ps(bind=bind, PARAMSERVER_OPTIONS=json.dumps(options))


def call(channel, method, payload):
    return codec.decode(channel.call(method, payload, 20).wait(20))


def registered(address, shared_memory=False):
    channel = GrpcChannel(address, 1 << 30, use_stream=True, use_shared_memory=shared_memory)
    channel.wait_ready(BOUND_S)
    call(channel, "Register", codec.encode({"group": "g", "optimizer": {"name": "sgd", "hyper": {"lr": 1}}},
                                           [("b", np.zeros(2, np.float32))]))
    return channel


def stream_port(address):
    channel = GrpcChannel(address, 1 << 20, use_stream=False)
    try:
        channel.wait_ready(BOUND_S)
        return call(channel, "Hello", codec.encode({})).meta["stream_port"]
    finally:
        channel.close()


def reply(sock):
    """(status, message) of the next reply on a raw stream connection."""
    _, kind, status, _, size = PREFIX.unpack(recv_exact(sock, PREFIX.size))
    return status, recv_exact(sock, size).decode(errors="replace")


def recv_exact(sock, size):
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def closed_by_peer(sock):
    """Blocks (up to the socket's timeout) until the PS closes the connection."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.cluster
@pytest.mark.parametrize("shared_memory", [False, True], ids=["tcp", "shm"])
def test_an_idle_connection_is_closed_and_the_client_reconnects_without_a_doubled_push(procs, shared_memory):
    _, address = start(procs, idle_timeout_s=0.5)
    channel = registered(address, shared_memory)
    try:
        big = np.ones(40_000, np.float32)  # over the shared-memory threshold: travels in the segment
        call(channel, "Register", codec.encode({"group": "h", "optimizer": {"name": "sgd", "hyper": {"lr": 1}}},
                                               [("big", np.zeros_like(big))]))
        sock = channel._stream._sock
        sock.settimeout(BOUND_S)
        # the PS closes the idle connection: wait for it without reading what belongs to the client
        assert socket.socket.recv(sock, 1, socket.MSG_PEEK) == b""
        pushed = call(channel, "PushPull", codec.encode({"pull": ["b", "big"]}, [("b", np.ones(2, np.float32)),
                                                                                  ("big", big)]))
        assert pushed.meta["version"] == 1  # applied once
        np.testing.assert_array_equal(pushed.tensors["b"], -np.ones(2, np.float32))
        np.testing.assert_array_equal(pushed.tensors["big"], -big)
        assert channel._stream._sock is not sock  # a new connection
    finally:
        channel.close()


@pytest.mark.cluster
def test_connections_past_max_connections_are_refused_with_a_clear_error(procs):
    _, address = start(procs, max_connections=2)
    port = stream_port(address)
    hello = codec.encode({})
    served = [socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) for _ in range(2)]
    try:
        for sock in served:  # both served: each answers a Hello
            sock.sendall(PREFIX.pack(b"PSTS", 0, 0, 0, len(hello)) + hello)
            assert reply(sock)[0] == 0
        with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as extra:
            status, message = reply(extra)
            assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "max_connections" in message
            assert closed_by_peer(extra)
        served.pop().close()  # a place frees up: a client connects and is served
        channel = registered(address)
        assert call(channel, "PushPull", codec.encode({"pull": ["b"]})).meta["version"] == 0
        channel.close()
    finally:
        for sock in served:
            sock.close()


@pytest.mark.cluster
def test_a_prefix_declaring_more_than_max_message_bytes_takes_no_memory(procs):
    proc, address = start(procs, max_message_bytes=1 << 20)
    port = stream_port(address)
    rss = psutil.Process(proc.pid).memory_info().rss
    socks = [socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) for _ in range(3)]
    try:
        for sock in socks:
            sock.sendall(PREFIX.pack(b"PSTS", 0, 0, 2, 1 << 30))
            status, message = reply(sock)
            assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "max_message_bytes" in message
            assert closed_by_peer(sock)
        # within the limit, but only a few bytes sent: the buffer grows with what arrives
        slow = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
        socks.append(slow)
        slow.sendall(PREFIX.pack(b"PSTS", 0, 0, 2, 1000 * 1000) + b"x" * 100)
        channel = registered(address)  # the PS still serves others meanwhile
        channel.close()
        assert psutil.Process(proc.pid).memory_info().rss - rss < 64 << 20
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.cluster
def test_a_second_ps_on_an_address_in_use_fails_to_start(procs):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    _, address = start(procs, bind=f"127.0.0.1:{port}")
    second = procs.start([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "node", "--role", "ps",
                          "--index", "0", "--bind", f"127.0.0.1:{port}"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    out, err = second.communicate(timeout=BOUND_S)
    assert second.returncode != 0 and "PARAMSERVER_READY" not in out
    assert f"cannot bind 127.0.0.1:{port}" in err and "in use" in err
    channel = registered(address)  # the first one still serves every new connection
    assert call(channel, "PushPull", codec.encode({"pull": ["b"]})).meta["version"] == 0
    channel.close()
