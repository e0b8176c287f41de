"""A tensor stream's drain: a request in flight when it begins is answered (within the grace), a request
that comes after it is answered UNAVAILABLE, and no new connection is taken. In one process: a
StreamServer over a service whose RegisterTable waits until the test lets it go (a restore that
takes long, made slow deterministically)."""

import socket
import struct
import threading
import time

import grpc
import pytest

from paramserver.transport import stream as stream_mod
from paramserver.transport.stream_server import StreamServer
from paramserver.wire import codec

PREFIX = struct.Struct("<4sBBHQ")
REGISTER_TABLE = stream_mod.METHODS.index("RegisterTable")
HELLO = stream_mod.METHODS.index("Hello")
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


class SlowService:
    """Answers every request at once, except RegisterTable: it waits for `release` (at most 30 s)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def decode(self, method: str, payload) -> str:
        return method

    def serve(self, method: str, sink):
        if method == "RegisterTable":
            self.entered.set()
            self.release.wait(30)
        return sink(codec.encode_parts({"served": method}))


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def send(sock: socket.socket, method: int, meta: dict) -> None:
    frame = codec.encode(meta)
    sock.sendall(PREFIX.pack(stream_mod.MAGIC, stream_mod.REQUEST, 0, method, len(frame)) + frame)


def reply(sock: socket.socket) -> tuple[int, bytes] | None:
    """(status, payload) of the next reply; None when the server closed the connection first."""
    data = b""
    try:
        while len(data) < PREFIX.size:
            chunk = sock.recv(PREFIX.size - len(data))
            if not chunk:
                return None
            data += chunk
        _, _, status, _, size = PREFIX.unpack(data)
        body = b""
        while len(body) < size:
            chunk = sock.recv(size - len(body))
            if not chunk:
                return None
            body += chunk
    except ConnectionResetError:
        return None
    return status, body


def served(answer: tuple[int, bytes] | None) -> str:
    assert answer is not None and answer[0] == 0, answer
    return codec.decode(answer[1]).meta["served"]


@pytest.fixture
def server():
    service = SlowService()
    server = StreamServer(service, "127.0.0.1", 0, 1 << 20)
    server.start()
    try:
        yield server, service
    finally:
        service.release.set()
        server.stop(1)


def stop_in_thread(server: StreamServer, grace: float) -> tuple[threading.Thread, list[float]]:
    took: list[float] = []

    def stop() -> None:
        started = time.monotonic()
        server.stop(grace)
        took.append(time.monotonic() - started)

    thread = threading.Thread(target=stop, name="test-stream-stop", daemon=True)
    thread.start()
    return thread, took


def wait_draining(server: StreamServer) -> None:
    deadline = time.monotonic() + 10
    while not server.draining:
        assert time.monotonic() < deadline, "the drain did not begin"
        time.sleep(0.01)


def wait_idle(server: StreamServer) -> None:
    deadline = time.monotonic() + 10
    while server.in_flight > 0:
        assert time.monotonic() < deadline, "a request answered is still counted in flight"
        time.sleep(0.01)


def wait_in_flight(server: StreamServer) -> None:
    deadline = time.monotonic() + 10
    while server.in_flight < 1:
        assert time.monotonic() < deadline, "the request's prefix was not read"
        time.sleep(0.01)


def test_a_request_in_flight_when_the_drain_begins_gets_its_reply_and_a_later_one_unavailable(server):
    server, service = server
    slow, idle = connect(server.port), connect(server.port)
    try:
        send(idle, HELLO, {})
        assert served(reply(idle)) == "Hello"  # admitted, then idle
        send(slow, REGISTER_TABLE, {"table": "t"})
        assert service.entered.wait(10)
        stopping, took = stop_in_thread(server, grace=20)
        wait_draining(server)

        send(idle, HELLO, {})  # after the drain began: refused, with its reason, and closed
        status, message = reply(idle) or (None, b"")
        assert status == UNAVAILABLE and b"draining" in message, (status, message)
        assert reply(idle) is None
        with pytest.raises(OSError):  # no new connection
            connect(server.port).close()
        assert stopping.is_alive()  # stop waits for the request in flight

        service.release.set()
        assert served(reply(slow)) == "RegisterTable"  # its reply, not a cut connection
        stopping.join(10)
        assert not stopping.is_alive() and took[0] < 10, took  # done once the request was answered
        assert reply(slow) is None  # then the connection closes
    finally:
        slow.close()
        idle.close()


def test_a_request_still_in_flight_when_the_grace_ends_is_cut_off(server):
    server, service = server
    slow = connect(server.port)
    try:
        send(slow, REGISTER_TABLE, {"table": "t"})
        assert service.entered.wait(10)
        started = time.monotonic()
        server.stop(0.5)
        took = time.monotonic() - started
        assert 0.4 < took < 3, took
        assert reply(slow) is None
    finally:
        slow.close()


def test_a_request_whose_bytes_are_still_arriving_when_the_drain_begins_is_served(server):
    server, _ = server
    sock = connect(server.port)
    try:
        send(sock, HELLO, {})
        assert served(reply(sock)) == "Hello"
        wait_idle(server)  # the Hello counts in flight until just after its reply is sent
        frame = codec.encode({"table": "t"})
        message = PREFIX.pack(stream_mod.MAGIC, stream_mod.REQUEST, 0, HELLO, len(frame)) + frame
        sock.sendall(message[: PREFIX.size + 4])  # in flight: its prefix is read, its frame is not
        wait_in_flight(server)
        stopping, _ = stop_in_thread(server, grace=20)
        wait_draining(server)
        sock.sendall(message[PREFIX.size + 4 :])
        assert served(reply(sock)) == "Hello"
        stopping.join(10)
        assert not stopping.is_alive()
    finally:
        sock.close()
