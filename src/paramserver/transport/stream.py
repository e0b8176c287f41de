"""The tensor stream: a plain TCP connection per (worker, shard) for the bulk calls.

gRPC's Python binding spends 3-4x more CPU per byte than a socket on multi-megabyte
messages (docs/performance.md), and a push or pull moves megabytes every step. So the
bulk calls (Register, PushPull) travel on this stream, while gRPC keeps discovery and
Hello. A PS announces its stream port and host id in its Hello reply.

When worker and PS run on the same host, the worker attaches a shared-memory segment to
its stream: requests are encoded straight into the segment's first half and replies
written into its second half, and only 16-byte prefixes cross the socket.

Message = 16-byte prefix ``<4sBBHQ``: magic b"PSTS", kind, status (a gRPC status code
value, 0 = OK), method id (index in METHODS), payload length; then the payload, unless the
kind says it lies in shared memory. Kinds: 0 request, 1 reply, 2 request in shared
memory, 3 reply in shared memory, 4 attach (payload: JSON {"path", "capacity"}), 5 auth (payload:
the client's token, UTF-8; sent once, first, on a connection to a PS that checks tokens: until it
is accepted, every request is refused UNAUTHENTICATED and no segment is attached; a refused token
closes the connection). A failed reply's payload is the UTF-8 error message.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import struct
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc

from ..base.errors import (DeadlineExceededError, MalformedFrameError, ParamServerError, UnavailableError,
                           error_for_status)
from ..base.lifecycle import Lifecycle, ReadyFlag
from . import codec
from .channel import CallHandle
from .dispatch import answer, introduce, needs_token

log = logging.getLogger(__name__)
MAGIC = b"PSTS"
METHODS = ("Hello", "Register", "PushPull", "SetMode", "Leave", "RegisterTable", "Lookup", "PushSparse")
_PREFIX = struct.Struct("<4sBBHQ")
REQUEST, REPLY, REQUEST_SHM, REPLY_SHM, ATTACH, AUTH = range(6)
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_SOCKET_BUFFER = 8 * 1024 * 1024
_SHM_MIN_BYTES = 64 * 1024  # smaller messages go inline: not worth a segment
_ANONYMOUS_BYTES = 64 * 1024  # the most a PS that checks tokens reads from a connection before its token
_OWNED_REPLY_BYTES = 1 << 20  # replies up to this size are returned as owned bytes, larger ones as views
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_SHM_PREFIX = "paramserver-"


def host_id() -> str:
    """Identifies this host's shared memory: same id, same host (and boot)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


def _shut(sock: socket.socket) -> None:
    """Shut a socket down both ways and close it: a thread blocked in accept or recv on it wakes."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected, or already closed
        pass
    sock.close()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)


class _Inbox:
    """A receive buffer reused across messages (fresh multi-megabyte buffers cost page faults).

    What `receive` returns is valid until the next `receive`. Not thread-safe.
    """

    def __init__(self) -> None:
        self._buffer = bytearray(_PREFIX.size)

    def receive(self, sock: socket.socket, size: int) -> memoryview:
        if len(self._buffer) < size:
            self._buffer = bytearray(size)
        view, got = memoryview(self._buffer)[:size], 0
        while got < size:
            n = sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("peer closed the tensor stream")
            got += n
        return view


def _send(sock: socket.socket, kind: int, status: int, method: int, parts: list, size: int, inline: bool) -> None:
    sock.sendall(_PREFIX.pack(MAGIC, kind, status, method, size))
    if inline:
        for part in parts:
            sock.sendall(part)


def _read_prefix(sock: socket.socket, max_bytes: int) -> tuple[int, int, int, int]:
    prefix = bytearray(_PREFIX.size)
    if sock.recv_into(prefix, _PREFIX.size, socket.MSG_WAITALL) != _PREFIX.size:
        raise ConnectionError("peer closed the tensor stream")
    magic, kind, status, method, size = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise MalformedFrameError(f"tensor stream message does not start with {MAGIC!r}")
    if size > max_bytes:
        raise MalformedFrameError(f"tensor stream message of {size} bytes exceeds the maximum {max_bytes}")
    return kind, status, method, size


def _write_parts(target: memoryview, parts: list) -> None:
    offset = 0
    for part in parts:
        part = memoryview(part).cast("B")
        target[offset:offset + len(part)] = part
        offset += len(part)


class _Segment:
    """A shared-memory segment of two halves: [0, capacity) requests, [capacity, 2*capacity) replies."""

    def __init__(self, path: str, capacity: int, create: bool) -> None:
        self.path, self.capacity = path, capacity
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, 2 * capacity)
            elif os.fstat(fd).st_size < 2 * capacity:
                raise ValueError(f"segment {path} is smaller than 2 x {capacity} bytes")
            self._map = mmap.mmap(fd, 2 * capacity)
        finally:
            os.close(fd)
        self.view = memoryview(self._map)
        self.requests = self.view[:capacity]
        self.replies = self.view[capacity:]

    def write(self, parts: list) -> int | None:
        """Copy a reply's parts into the reply half; None if they do not fit."""
        size = codec.parts_size(parts)
        if size > self.capacity:
            return None
        _write_parts(self.replies, parts)
        return size

    def close(self) -> None:
        try:
            for view in (self.requests, self.replies, self.view):
                view.release()
            self._map.close()
        except BufferError:  # arrays still view the segment; the mapping goes when they do
            pass


class StreamServer(Lifecycle):
    """Accepts tensor streams and answers each with `service.call`. A thread per connection.

    Lifecycle (base/lifecycle.py): the port is bound when built; `start()` starts the accepting
    thread ("ps-stream-accept") and returns the port; `wait_ready(timeout)`; `stop(grace)` closes
    the listener and every connection (a call being answered is cut off) and joins the threads
    ("ps-stream-<peer port>"), at most `grace` seconds in all.
    """

    def __init__(self, service, host: str, port: int, max_message_bytes: int) -> None:
        self.service = service
        self.max_message_bytes = max_message_bytes
        self._listener = socket.create_server((host, port), backlog=64)
        self.port = self._listener.getsockname()[1]
        self.ready = ReadyFlag(f"tensor stream on port {self.port}")
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="ps-stream-accept", daemon=True)

    def start(self) -> int:
        with self._lock:
            if self._stopping.is_set():
                raise UnavailableError(f"tensor stream on port {self.port} was stopped")
            self._acceptor.start()
        self.ready.set()
        return self.port

    def wait_ready(self, timeout: float) -> None:
        """Accepting as soon as `start` returned: this only says whether it did (and waits for it)."""
        self.ready.wait(timeout)

    def stop(self, grace: float = 2.0) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            self.ready.fail(UnavailableError(f"tensor stream on port {self.port} stopped"))
            connections = dict(self._connections)
        _shut(self._listener)  # wakes the accepting thread (a plain close does not, on Linux)
        for conn in connections:
            _shut(conn)  # wakes a thread blocked reading it
        deadline = time.monotonic() + grace  # no connection is added from now on (_accept checks, locked)
        for thread in [self._acceptor, *connections.values()]:
            if thread.ident is not None:  # started
                thread.join(max(0.0, deadline - time.monotonic()))

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            _tune(conn)
            thread = threading.Thread(target=self._serve, args=(conn, peer), name=f"ps-stream-{peer[1]}",
                                      daemon=True)
            with self._lock:
                if self._stopping.is_set():
                    conn.close()
                    return
                self._connections[conn] = thread
                thread.start()

    def _serve(self, conn: socket.socket, peer) -> None:
        segment: _Segment | None = None
        inbox = _Inbox()
        token: str | None = None  # the connection's token, once accepted
        try:
            while True:
                kind, _, method_id, size = _read_prefix(conn, self.max_message_bytes)
                if kind == AUTH:
                    token = self._authenticate(conn, size, inbox, peer)
                    continue
                if token is None and size > _ANONYMOUS_BYTES and needs_token(self.service):
                    # not read: a caller without a token gets no memory (the refusal ends the connection)
                    _refuse(conn, grpc.StatusCode.UNAUTHENTICATED, "the tensor stream needs an accepted token first")
                    raise ConnectionError("a large message before any token")
                if kind == ATTACH and token is None and needs_token(self.service):
                    inbox.receive(conn, size)
                    _refuse(conn, grpc.StatusCode.UNAUTHENTICATED, "shared memory needs an accepted token first")
                    continue
                if kind == ATTACH:
                    segment = self._attach(conn, inbox.receive(conn, size), segment)
                    continue
                if kind == REQUEST_SHM and segment is not None and size <= segment.capacity:
                    payload = segment.requests[:size]
                elif kind == REQUEST:
                    payload = inbox.receive(conn, size)
                else:
                    raise MalformedFrameError(f"unexpected tensor stream message kind {kind}")
                status, reply = self._answer(method_id, payload, peer, segment, token)
                if isinstance(reply, int):  # already written into the segment
                    _send(conn, REPLY_SHM, status, method_id, [], reply, False)
                else:
                    _send(conn, REPLY, status, method_id, [reply], len(reply), True)
        except (OSError, ConnectionError, MalformedFrameError) as exc:
            if not self._stopping.is_set():
                log.info("tensor stream from %s closed: %s", peer, exc)
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            conn.close()
            if segment is not None:
                segment.close()

    def _attach(self, conn: socket.socket, request: memoryview, old: _Segment | None) -> _Segment | None:
        try:
            spec = json.loads(bytes(request))
            path = str(spec["path"])
            # only segments a worker made for us: never let a peer point the PS at another file
            if os.path.dirname(path) != _SHM_DIR or not os.path.basename(path).startswith(_SHM_PREFIX):
                raise ValueError(f"{path!r} is not a paramserver segment in {_SHM_DIR}")
            segment = _Segment(path, int(spec["capacity"]), create=False)
        except (ValueError, KeyError, TypeError, OSError) as exc:
            message = f"cannot attach shared memory: {exc}".encode()
            _send(conn, REPLY, grpc.StatusCode.INVALID_ARGUMENT.value[0], 0, [message], len(message), True)
            return old
        if old is not None:
            old.close()
        _send(conn, REPLY, 0, 0, [], 0, True)
        return segment

    def _authenticate(self, conn: socket.socket, size: int, inbox: _Inbox, peer) -> str:
        """The connection's token, once the service accepted it; a refused one closes the connection."""
        if size > _ANONYMOUS_BYTES:
            _refuse(conn, grpc.StatusCode.UNAUTHENTICATED, f"a token of {size} bytes is not a token")
            raise ConnectionError("an oversized auth message")
        token = bytes(inbox.receive(conn, size)).decode(errors="replace")
        refused = introduce(self.service, token, str(peer))
        if refused is not None:
            _refuse(conn, refused.code, str(refused))
            raise ConnectionError(f"token refused: {refused}")
        _send(conn, REPLY, 0, 0, [], 0, True)
        return token

    def _answer(self, method_id: int, payload, peer, segment: _Segment | None,
                token: str | None = None) -> tuple[int, bytes | int]:
        """(status, reply bytes) or, when the reply went into the segment, (0, its size)."""
        def sink(parts: list) -> bytes | int:
            size = segment.write(parts) if segment is not None else None
            return b"".join(parts) if size is None else size

        if method_id >= len(METHODS):
            message = f"unknown tensor stream method id {method_id}"
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], message.encode()
        result = answer(self.service, METHODS[method_id], payload, str(peer), sink, token)
        return (0, result.reply) if result.ok else (result.code.value[0], result.reply.encode())


def _refuse(conn: socket.socket, code: grpc.StatusCode, message: str) -> None:
    data = message.encode()
    _send(conn, REPLY, code.value[0], 0, [data], len(data), True)


class StreamCall(CallHandle):
    """A call sent on a tensor stream. Its reply is read by `wait` in the caller's thread (or by
    the next call on the stream, which then keeps an owned copy for this one)."""

    def __init__(self, client: "StreamClient", describe: str, deadline: float, owned: bool) -> None:
        self._client, self.describe, self.deadline, self.owned = client, describe, deadline, owned
        self.reply: memoryview | bytes | None = None
        self.error: ParamServerError | None = None

    def done(self) -> bool:
        return self.reply is not None or self.error is not None

    def wait_sent(self, timeout: float) -> None:
        """The request was copied out before `call` returned: nothing to wait for."""

    def wait(self, timeout: float) -> memoryview | bytes:
        if not self.done():
            self._client.finish(self, min(self.deadline, time.monotonic() + timeout))
        if self.error is not None:
            raise self.error
        return self.reply


class StreamClient:
    """One tensor stream to a shard. Thread-safe; calls on one stream are answered in order.

    A call sends its request in the caller's thread and returns; the reply is read when the
    call is waited for (no hand-off to another thread: each one costs a wake-up and a turn
    at the GIL). One call is in flight at a time, because requests and replies reuse one
    buffer: a new call first reads the previous call's reply. With `shared_memory`, bulk
    messages go through a segment attached to the stream. A broken connection is reopened
    on the next call; a call never waits past its deadline.
    """

    def __init__(self, host: str, port: int, max_message_bytes: int, label: str, shared_memory: bool,
                 token: str | None = None) -> None:
        self.address = f"{host}:{port}"
        self._host, self._port = host, port
        self.max_message_bytes = max_message_bytes
        self.shared_memory = shared_memory
        self._token = token  # presented once per connection (an auth message), before any request
        self._sock: socket.socket | None = None
        self._segment: _Segment | None = None
        self._inbox = _Inbox()
        self._lock = threading.Lock()
        self._in_flight: StreamCall | None = None

    def call(self, method: str, payload: bytes | list, timeout: float, owned: bool = False) -> StreamCall:
        parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        call = StreamCall(self, f"{self.address} {method}", time.monotonic() + timeout, owned)
        with self._lock:
            if self._in_flight is not None:  # its reply would be overwritten: read it now, as a copy
                previous, previous.owned = self._in_flight, True
                self._receive(previous, previous.deadline)
            try:
                self._send_request(METHODS.index(method), parts, call.deadline)
                self._in_flight = call
            except ParamServerError as exc:
                call.error = exc
        return call

    def finish(self, call: StreamCall, deadline: float) -> None:
        """Read `call`'s reply (called by its `wait`)."""
        with self._lock:
            if not call.done():
                self._receive(call, deadline)

    def _send_request(self, method_id: int, parts: list, deadline: float) -> None:
        size = codec.parts_size(parts)
        try:
            sock = self._connect(deadline)
            segment = self._segment_for(sock, size) if self.shared_memory and size >= _SHM_MIN_BYTES else None
            if segment is not None:
                _write_parts(segment.requests, parts)
            _send(sock, REQUEST_SHM if segment else REQUEST, 0, method_id, parts, size, segment is None)
        except (OSError, ConnectionError) as exc:
            raise self._broken(METHODS[method_id], exc) from None

    def _receive(self, call: StreamCall, deadline: float) -> None:
        """Read the in-flight reply into `call`: owned bytes if small or `call.owned`, else a view
        valid until the next call on this client."""
        self._in_flight = None
        try:
            self._sock.settimeout(max(0.001, deadline - time.monotonic()))
            kind, status, _, reply_size = _read_prefix(self._sock, self.max_message_bytes)
            if kind == REPLY_SHM and self._segment is not None:
                reply = self._segment.replies[:reply_size]
            else:
                reply = self._inbox.receive(self._sock, reply_size)
            if call.owned or reply_size <= _OWNED_REPLY_BYTES:
                reply = bytes(reply)
        except (OSError, ConnectionError, MalformedFrameError) as exc:
            call.error = self._broken(call.describe, exc)
            return
        if status:
            call.error = error_for_status(_CODES.get(status, grpc.StatusCode.UNKNOWN),
                                          f"{call.describe}: {bytes(reply).decode(errors='replace')}")
        else:
            call.reply = reply

    def _broken(self, what: str, exc: Exception) -> ParamServerError:
        self._drop()
        if isinstance(exc, socket.timeout):
            return DeadlineExceededError(f"{self.address} {what}: no reply before the deadline")
        return UnavailableError(f"{self.address} {what}: tensor stream failed: {exc}")

    def _connect(self, deadline: float) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection((self._host, self._port), timeout=max(0.001, deadline - time.monotonic()))
            _tune(sock)
            if self._token:
                self._present_token(sock, deadline)
            self._sock = sock
        self._sock.settimeout(max(0.001, deadline - time.monotonic()))
        return self._sock

    def _present_token(self, sock: socket.socket, deadline: float) -> None:
        """Send the auth message and read its answer; a refusal closes the socket and is raised."""
        data = self._token.encode()
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            _send(sock, AUTH, 0, 0, [data], len(data), True)
            _, status, _, size = _read_prefix(sock, self.max_message_bytes)
            reason = bytes(self._inbox.receive(sock, size)).decode(errors="replace")
        except BaseException:
            sock.close()
            raise
        if status:
            sock.close()
            raise error_for_status(_CODES.get(status, grpc.StatusCode.UNKNOWN), f"{self.address}: {reason}")

    def _segment_for(self, sock: socket.socket, size: int) -> _Segment | None:
        """The attached segment, (re)created with room for `size`; None if the PS cannot attach it."""
        if self._segment is not None and self._segment.capacity >= size:
            return self._segment
        capacity = max(2 * size, 1 << 20)
        path = os.path.join(_SHM_DIR, f"{_SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        segment = _Segment(path, capacity, create=True)
        try:
            spec = json.dumps({"path": path, "capacity": capacity}).encode()
            _send(sock, ATTACH, 0, 0, [spec], len(spec), True)
            _, status, _, reply_size = _read_prefix(sock, self.max_message_bytes)
            reason = bytes(self._inbox.receive(sock, reply_size))
        finally:
            os.unlink(path)  # both sides hold a mapping; the memory goes away with the last one
        if status:
            log.warning("%s: shared memory refused (%s); sending inline", self.address, reason.decode(errors="replace"))
            segment.close()
            self.shared_memory = False
            return None
        if self._segment is not None:
            self._segment.close()
        self._segment = segment
        return segment

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def close(self) -> None:
        with self._lock:
            if self._in_flight is not None:
                self._in_flight.error = UnavailableError(f"{self.address}: tensor stream closed")
                self._in_flight = None
            self._drop()
