"""A stream server on TLS in this process: a failed handshake is counted and the server goes on, and payloads
past the message limit travel in parts. Certificates are made by the test (tests/tls_pki.py).
Real nodes on TLS and mutual TLS: tests/integration/test_tls.py."""

import socket
import threading

import numpy as np
import pytest
from tests.tls_pki import material, write_pki

from paramserver.server.shard import Shard
from paramserver.server.shard_service import ShardService
from paramserver.transport.stream_client import StreamClient
from paramserver.transport.stream_server import StreamServer
from paramserver.wire import codec

BOUND_S = 30.0  # how long a refusal may take to arrive; never reached (a refusal is immediate)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The cluster's CA and node certificates, and another CA's (an outsider's)."""
    return write_pki(tmp_path_factory.mktemp("pki"))


def test_a_failed_handshake_is_counted_and_the_stream_server_goes_on(pki):
    """In process, to see the server's count: a refused peer costs one log line and its connection;
    stopping the server ends the threads of refused and of TLS connections alike."""
    before = set(threading.enumerate())
    server = StreamServer(ShardService(Shard(0)), "127.0.0.1", 0, 1 << 20,
                          tls=material(pki, "cluster", "ps-0").server_context)
    server.start()
    client = StreamClient("127.0.0.1", server.port, 1 << 20, "test", shared_memory=False,
                          tls=material(pki, "cluster", "client").client_context)
    try:
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", server.port), timeout=BOUND_S) as sock:
                sock.sendall(b"PSTS not a handshake")
                try:
                    assert sock.recv(100) == b""  # closed by the server, which answered nothing
                except ConnectionResetError:  # closed with our bytes unread: the same refusal
                    pass
        assert server.refused == 2  # counted before the connection was closed
        hello = codec.decode(client.call("Hello", codec.encode({}), BOUND_S).wait(BOUND_S))
        assert hello.meta["protocol"]
    finally:
        client.close()
        server.stop(BOUND_S)
    assert not [t for t in threading.enumerate() if t.name.startswith("ps-stream") and t not in before]


def test_payloads_past_the_message_limit_travel_in_parts_over_tls(pki):
    """A 160 KB registration and its pull through a stream that allows 4 KiB messages, on TLS."""
    server = StreamServer(ShardService(Shard(0)), "127.0.0.1", 0, 4096,
                          tls=material(pki, "cluster", "ps-0").server_context)
    server.start()
    client = StreamClient("127.0.0.1", server.port, 4096, "test", shared_memory=False,
                          tls=material(pki, "cluster", "client").client_context)
    values = np.linspace(-1, 1, 40_000, dtype=np.float32)
    try:
        register = {"group": "g", "optimizer": {"name": "sgd", "hyper": {"lr": 0.5}}}
        client.call("Register", codec.encode_parts(register, [("w", values)]), BOUND_S).wait(BOUND_S)
        pulled = codec.decode(client.call("PushPull", codec.encode({"pull": ["w"]}), BOUND_S).wait(BOUND_S))
        np.testing.assert_array_equal(pulled.tensors["w"], values)
    finally:
        client.close()
        server.stop(BOUND_S)
