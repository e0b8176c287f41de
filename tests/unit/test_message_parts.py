"""Payloads past max_message_bytes travel in parts: no message on the wire is longer than the limit,
and a sequence of parts that does not make one request is refused cleanly."""

import socket

import grpc
import numpy as np
import pytest

from paramserver.base.config import Options
from paramserver.base.errors import ResourceExhaustedError
from paramserver.client.ps_client import PSClient
from paramserver.node.ps_node import PSNode
from paramserver.transport import grpc_transport, stream, stream_client, stream_server
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.transport.stream import MORE, PREFIX, REQUEST, REQUEST_SHM
from paramserver.wire import codec

LIMIT = 4096
PAYLOAD = 1 << 20
TRANSPORTS = {"shm": dict(use_stream=True, use_shared_memory=True),
              "tcp": dict(use_stream=True, use_shared_memory=False), "grpc": dict(use_stream=False)}
SGD = {"name": "sgd", "hyper": {"lr": 0.5}}


@pytest.fixture
def node():
    ps = PSNode("127.0.0.1:0", 0, Options(max_message_bytes=LIMIT, max_payload_bytes=PAYLOAD))
    address = ps.start()
    ps.wait_ready(10)
    yield ps, address
    ps.stop(1.0)


@pytest.fixture
def wire(monkeypatch):
    """Sizes of every tensor-stream message read (by either end) and of every gRPC chunk made."""
    sizes = {"stream": [], "grpc": []}
    read_prefix, split_parts = stream.read_prefix, codec.split_parts

    def reading(sock, max_bytes=None):
        prefix = read_prefix(sock, max_bytes)
        sizes["stream"].append(prefix[3])
        return prefix

    def cutting(parts, chunk_bytes):
        for piece in split_parts(parts, chunk_bytes):
            sizes["grpc"].append(sum(len(view) for view in piece))
            yield piece

    for module in (stream_client, stream_server):
        monkeypatch.setattr(module, "read_prefix", reading)
    monkeypatch.setattr(stream, "read_prefix", reading)  # parts after the first, and acknowledgements
    monkeypatch.setattr(grpc_transport, "split_parts", cutting)
    return sizes


def client_for(address: str, transport: str) -> PSClient:
    client = PSClient([GrpcChannel(address, LIMIT, max_payload_bytes=PAYLOAD, **TRANSPORTS[transport])], 10.0)
    client.connect(10.0)
    return client


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_no_message_on_the_wire_exceeds_the_limit(node, wire, transport):
    client = client_for(node[1], transport)
    values = np.linspace(-1, 1, 40_000, dtype=np.float32)  # 160 KB: 40 times the limit
    grads = np.linspace(2, 3, 40_000, dtype=np.float32)
    try:
        _, registered = client.register("g", SGD, {"w": values}).wait(10.0)
        _, pulled = client.push_pull({"w": grads}, ["w"]).wait(10.0)
        np.testing.assert_array_equal(registered[0][1], values)
        np.testing.assert_array_equal(pulled[0][1], values - np.float32(0.5) * grads)
    finally:
        client.close()
    sizes = wire["grpc" if transport == "grpc" else "stream"]
    assert max(sizes) <= LIMIT
    assert sum(sizes) >= 3 * values.nbytes  # registered, pushed and pulled, in parts
    if transport == "shm":  # the parts went through the segment: its acknowledgements were read
        assert sizes.count(0) >= 3 * values.nbytes // LIMIT - 3


def test_a_request_past_max_payload_bytes_is_refused_before_it_is_sent(node):
    client = client_for(node[1], "tcp")
    try:
        with pytest.raises(ResourceExhaustedError, match="max_payload_bytes"):
            client.register("g", SGD, {"w": np.zeros(PAYLOAD // 4 + 1, np.float32)}).wait(10.0)
        assert not node[0].service.shard.describe()["groups"]
    finally:
        client.close()


def raw_stream(node) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", node[0].stream.port), timeout=10)
    return sock


def part(kind: int, method: int, body: bytes) -> bytes:
    return PREFIX.pack(stream.MAGIC, kind, 0, method, len(body)) + body


def refusal(sock: socket.socket) -> tuple[int, str]:
    """The PS's answer (status, message) and that it then closed the connection."""
    _, status, _, size = stream.read_prefix(sock)
    message = stream.Inbox().receive(sock, size).tobytes().decode()
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:  # closed with the rest of our parts unread
        pass
    return status, message


PUSH_PULL = stream.METHODS.index("PushPull")
REGISTER = stream.METHODS.index("Register")


@pytest.mark.parametrize("parts, code, fragment", [
    ([(REQUEST | MORE, PUSH_PULL, b"x" * 100), (REQUEST | MORE, REGISTER, b"y" * 100)], 3, "inside a message"),
    ([(REQUEST | MORE, PUSH_PULL, b"")], 3, "empty part"),
    ([(REQUEST | MORE, PUSH_PULL, b"x" * 100), (stream.ATTACH, PUSH_PULL, b"{}")], 3, "does not belong"),
    ([(REQUEST_SHM | MORE, PUSH_PULL, b"")], 3, "does not belong"),  # no segment attached
    ([(REQUEST | MORE, PUSH_PULL, b"x" * LIMIT)] * (PAYLOAD // LIMIT) + [(REQUEST, PUSH_PULL, b"x")], 8,
     "max_payload_bytes"),
])
def test_a_malformed_sequence_of_parts_is_refused_and_changes_nothing(node, parts, code, fragment):
    shard = node[0].service.shard
    before = (shard.version, shard.describe())
    with raw_stream(node) as sock:
        try:
            sock.sendall(b"".join(part(*p) for p in parts))
        except OSError:  # the PS may refuse and close before every part went out
            pass
        status, message = refusal(sock)
    assert status == code and fragment in message
    assert (shard.version, shard.describe()) == before


@pytest.mark.parametrize("chunks, code", [([b"x" * LIMIT] * (PAYLOAD // LIMIT + 1), grpc.StatusCode.RESOURCE_EXHAUSTED),
                                          ([], grpc.StatusCode.INVALID_ARGUMENT)])
def test_a_chunked_grpc_request_past_max_payload_bytes_or_empty_is_refused(node, chunks, code):
    shard = node[0].service.shard
    before = (shard.version, shard.describe())
    with grpc.insecure_channel(node[1], options=grpc_transport.channel_options(LIMIT)) as channel:
        call = channel.stream_stream(f"/{grpc_transport.SERVICE}/PushPull{grpc_transport.CHUNKED}")
        with pytest.raises(grpc.RpcError) as caught:
            list(call(iter(chunks), timeout=10))
    assert caught.value.code() == code
    assert (shard.version, shard.describe()) == before
