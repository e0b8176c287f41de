"""The tensor stream: a plain TCP connection per (worker, shard) for the bulk calls.

gRPC's Python binding spends 3-4x more CPU per byte than a socket on multi-megabyte
messages (docs/performance.md), and a push or pull moves megabytes every step. So the
bulk calls (Register, PushPull) travel on this stream, while gRPC keeps discovery and
Hello. A PS announces its stream port and host id in its Hello reply.

When worker and PS run on the same host, the worker attaches a shared-memory segment to
its stream (transport/shared_memory.py: a sealed memfd): requests are encoded straight into
the segment's first half (the PS copies each out before checking it) and replies written
into its second half, and only 16-byte prefixes cross the socket.

Limits (Options): a message longer than `max_message_bytes` is refused before any memory is
taken for it, and a receive buffer grows with the bytes that arrive, never ahead of them; a
connection without a request for `idle_timeout_s` is closed (the client notices before its
next call and reconnects); at most `max_connections` connections are served at once, a
further one is answered RESOURCE_EXHAUSTED and closed.

Message = 16-byte prefix ``<4sBBHQ``: magic b"PSTS", kind, status (a gRPC status code
value, 0 = OK), method id (index in METHODS), payload length; then the payload, unless the
kind says it lies in shared memory. Kinds: 0 request, 1 reply, 2 request in shared
memory, 3 reply in shared memory, 4 attach (payload: JSON {"pid", "fd", "capacity"}), 5 auth (payload:
the client's token, UTF-8; sent once, first, on a connection to a PS that checks tokens: until it
is accepted, every request is refused UNAUTHENTICATED, nothing over 64 KiB is read and no segment
is attached; a refused token closes the connection). A failed reply's payload is the UTF-8 error
message.

With TLS (an `ssl.SSLContext` on both ends, base/tls.py), every connection starts with a TLS
handshake and carries the same messages inside it; a peer that fails the handshake (no
certificate, one from another CA, plaintext) is logged, counted (`StreamServer.refused`) and
closed before any message is read. Shared memory stays available: its attach message travels
inside the authenticated connection.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import struct
import threading
import time
from pathlib import Path

import grpc

from ..base.errors import (DeadlineExceededError, MalformedFrameError, ParamServerError, UnauthenticatedError,
                           UnavailableError, error_for_status)
from ..base.lifecycle import Lifecycle, ReadyFlag
from . import codec
from .channel import CallHandle
from .dispatch import answer, introduce, needs_token, turned_away
from .shared_memory import Segment, SegmentError, write_parts

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
_FIRST_CHUNK = 1 << 20  # a receive buffer grows from here as bytes arrive (a prefix alone proves nothing)
_REFUSE_TIMEOUT_S = 1.0  # longest send of a refusal to a connection that is not served
_HANDSHAKE_TIMEOUT_S = 10.0  # a TLS peer that stalls its handshake gives up its thread after this
_TLS_COALESCE_BYTES = 64 * 1024  # TLS: parts up to this size share records (each sendall is a record)


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
        """`size` bytes from `sock`; the buffer grows (doubling) only as the bytes arrive."""
        got = 0
        while got < size:
            if got == len(self._buffer):
                self._grow(got, min(size, max(2 * got, _FIRST_CHUNK)))
            n = sock.recv_into(memoryview(self._buffer)[got:min(size, len(self._buffer))])
            if n == 0:
                raise ConnectionError("peer closed the tensor stream")
            got += n
        return memoryview(self._buffer)[:size]

    def copy(self, source: memoryview) -> memoryview:
        """A private copy of `source` (memory a peer may still write), in the reused buffer."""
        if len(self._buffer) < len(source):
            self._buffer = bytearray(len(source))
        view = memoryview(self._buffer)[:len(source)]
        view[:] = source
        return view

    def _grow(self, keep: int, size: int) -> None:
        grown = bytearray(size)
        grown[:keep] = memoryview(self._buffer)[:keep]
        self._buffer = grown


def _send(sock: socket.socket, kind: int, status: int, method: int, parts: list, size: int, inline: bool) -> None:
    if isinstance(sock, ssl.SSLSocket):
        _send_tls(sock, _PREFIX.pack(MAGIC, kind, status, method, size), parts if inline else [])
        return
    sock.sendall(_PREFIX.pack(MAGIC, kind, status, method, size))
    if inline:
        for part in parts:
            sock.sendall(part)


def _send_tls(sock: ssl.SSLSocket, prefix: bytes, parts: list) -> None:
    """The prefix and the parts, small ones joined: each sendall on TLS is at least one record."""
    pending = bytearray(prefix)
    for part in parts:
        part = memoryview(part).cast("B")
        if len(part) > _TLS_COALESCE_BYTES:
            sock.sendall(pending)
            pending = bytearray()
            sock.sendall(part)
        else:
            pending += part
    if pending:
        sock.sendall(pending)


def _read_prefix(sock: socket.socket, max_bytes: int | None = None) -> tuple[int, int, int, int]:
    """The next message's prefix; with `max_bytes`, a longer message is a MalformedFrameError."""
    prefix, got = bytearray(_PREFIX.size), 0
    while got < _PREFIX.size:  # a loop, not MSG_WAITALL: with a timeout set, recv may return part
        n = sock.recv_into(memoryview(prefix)[got:])
        if n == 0:
            raise ConnectionError("peer closed the tensor stream")
        got += n
    magic, kind, status, method, size = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise MalformedFrameError(f"tensor stream message does not start with {MAGIC!r}")
    if max_bytes is not None and size > max_bytes:
        raise MalformedFrameError(f"tensor stream message of {size} bytes exceeds the maximum {max_bytes}")
    return kind, status, method, size


def _send_error(sock: socket.socket, code: grpc.StatusCode, method: int, text: str) -> None:
    message = text.encode()
    _send(sock, REPLY, code.value[0], method, [message], len(message), True)


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the peer closed (or reset) an idle connection: checked before a request is sent on
    it, so that a request never goes out on a connection the PS already gave up (it reconnects)."""
    try:
        sock.setblocking(False)
        if isinstance(sock, ssl.SSLSocket):  # takes no flags; a read here also consumes TLS's own records
            sock.recv(1)
        else:
            sock.recv(1, socket.MSG_PEEK)  # end of stream, or a byte nobody asked for: broken either way
        return True
    except (BlockingIOError, ssl.SSLWantReadError):  # SSLWantReadError: no application data waiting
        return False
    except OSError:
        return True


class _Connection:
    """What a served connection has established: its attached segment and its accepted token."""

    def __init__(self) -> None:
        self.segment: Segment | None = None
        self.token: str | None = None


class StreamServer(Lifecycle):
    """Accepts tensor streams and answers each with `service.call`. A thread per connection.

    Lifecycle (base/lifecycle.py): the port is bound when built; `start()` starts the accepting
    thread ("ps-stream-accept") and returns the port; `wait_ready(timeout)`; `stop(grace)` closes
    the listener and every connection (a call being answered is cut off) and joins the threads
    ("ps-stream-<peer port>"), at most `grace` seconds in all.
    With `tls` (a server SSLContext), each connection's thread first runs the TLS handshake;
    `refused` counts the peers that failed it.
    """

    def __init__(self, service, host: str, port: int, max_message_bytes: int, idle_timeout_s: float = 300.0,
                 max_connections: int = 256, tls: ssl.SSLContext | None = None) -> None:
        self.service = service
        self.max_message_bytes = max_message_bytes
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.tls = tls
        self.refused = 0
        try:  # no SO_REUSEPORT: a port in use is an error here, never a second server sharing it
            self._listener = socket.create_server((host, port), backlog=64)
        except OSError as exc:
            raise UnavailableError(f"tensor stream cannot listen on {host}:{port}: {exc.strerror}") from None
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
                full = len(self._connections) >= self.max_connections
                if not full:
                    self._connections[conn] = thread
                    thread.start()
            if full:
                self._turn_away(conn, peer)

    def _turn_away(self, conn: socket.socket, peer) -> None:
        """Answer a connection past max_connections with the reason, and close it."""
        log.warning("tensor stream from %s refused: %d connections served already", peer, self.max_connections)
        try:
            conn.settimeout(_REFUSE_TIMEOUT_S)
            _send_error(conn, grpc.StatusCode.RESOURCE_EXHAUSTED, 0,
                        f"the PS serves {self.max_connections} tensor stream connections already (max_connections)")
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket, peer) -> None:
        if self.tls is not None:
            conn = self._handshake(conn, peer)
            if conn is None:
                return
        state = _Connection()
        inbox = _Inbox()
        conn.settimeout(self.idle_timeout_s)  # also bounds a request that stops half-way
        try:
            while self._serve_one(conn, peer, inbox, state):
                pass
        except socket.timeout:
            log.info("tensor stream from %s closed: idle for %.0fs (idle_timeout_s)", peer, self.idle_timeout_s)
        except (OSError, ConnectionError, MalformedFrameError) as exc:
            if not self._stopping.is_set():
                log.info("tensor stream from %s closed: %s", peer, exc)
        except Exception:  # noqa: BLE001 - a bug: this connection ends, the PS serves on
            log.exception("tensor stream from %s failed", peer)
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            conn.close()
            if state.segment is not None:
                state.segment.close()

    def _serve_one(self, conn: socket.socket, peer, inbox: _Inbox, state: "_Connection") -> bool:
        """Read and answer one message; False when the connection must close."""
        kind, _, method_id, size = _read_prefix(conn)
        if size > self.max_message_bytes:  # refused before a byte of it is read or allocated
            _send_error(conn, grpc.StatusCode.RESOURCE_EXHAUSTED, method_id,
                        f"message of {size} bytes exceeds max_message_bytes {self.max_message_bytes}")
            return False
        if kind == AUTH:
            state.token = self._authenticate(conn, size, inbox, peer)
            return True
        if state.token is None and needs_token(self.service):
            if size > _ANONYMOUS_BYTES:  # not read: a caller without a token gets no memory
                _send_error(conn, grpc.StatusCode.UNAUTHENTICATED, method_id,
                            "the tensor stream needs an accepted token first")
                return False
            if kind == ATTACH:
                inbox.receive(conn, size)
                _send_error(conn, grpc.StatusCode.UNAUTHENTICATED, 0, "shared memory needs an accepted token first")
                return True
        if kind == ATTACH:
            state.segment = self._attach(conn, inbox.receive(conn, size), state.segment)
            return True
        segment = state.segment
        if kind == REQUEST_SHM and segment is not None and size <= segment.capacity:
            payload = inbox.copy(segment.requests[:size])  # the worker can still write the segment
        elif kind == REQUEST:
            payload = inbox.receive(conn, size)
        else:
            _send_error(conn, grpc.StatusCode.INVALID_ARGUMENT, method_id,
                        f"unexpected tensor stream message kind {kind} of {size} bytes")
            return False
        status, reply = self._answer(method_id, payload, peer, segment, state.token)
        if isinstance(reply, int):  # already written into the segment
            _send(conn, REPLY_SHM, status, method_id, [], reply, False)
        else:
            _send(conn, REPLY, status, method_id, [reply], len(reply), True)
        return True

    def _handshake(self, conn: socket.socket, peer) -> ssl.SSLSocket | None:
        """The connection over TLS; None (logged, counted, closed) when the peer fails the handshake."""
        previous = conn.gettimeout()
        conn.settimeout(_HANDSHAKE_TIMEOUT_S)
        secure = None
        try:
            secure = self.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            secure.do_handshake()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            with self._lock:  # counted before the peer sees its connection end (stop() cuts handshakes too)
                self._connections.pop(conn, None)
                if not self._stopping.is_set():
                    self.refused += 1
                    log.warning("tensor stream from %s refused: TLS handshake failed: %s", peer, exc)
                    turned_away(self.service, "StreamTLS", str(peer),
                                UnauthenticatedError(f"TLS handshake failed: {exc}"))
            (conn if secure is None else secure).close()
            return None
        secure.settimeout(previous)
        with self._lock:  # from now on stop() must shut the TLS socket: the plain one was handed over to it
            thread = self._connections.pop(conn, None)
            if self._stopping.is_set():
                secure.close()
                return None
            self._connections[secure] = thread
        return secure

    def _attach(self, conn: socket.socket, request: memoryview, old: Segment | None) -> Segment | None:
        try:
            spec = json.loads(bytes(request))
            if not isinstance(spec, dict):
                raise SegmentError("attach needs a JSON object")
            segment = Segment.attach(spec)
        except (ValueError, RecursionError, OSError, OverflowError) as exc:  # SegmentError is a ValueError
            _send_error(conn, grpc.StatusCode.INVALID_ARGUMENT, 0, f"cannot attach shared memory: {exc}")
            return old
        if old is not None:
            old.close()
        _send(conn, REPLY, 0, 0, [], 0, True)
        return segment

    def _authenticate(self, conn: socket.socket, size: int, inbox: _Inbox, peer) -> str:
        """The connection's token, once the service accepted it; a refused one closes the connection."""
        if size > _ANONYMOUS_BYTES:
            _send_error(conn, grpc.StatusCode.UNAUTHENTICATED, 0, f"a token of {size} bytes is not a token")
            raise ConnectionError("an oversized auth message")
        token = bytes(inbox.receive(conn, size)).decode(errors="replace")
        refused = introduce(self.service, token, str(peer))
        if refused is not None:
            _send_error(conn, refused.code, 0, str(refused))
            raise ConnectionError(f"token refused: {refused}")
        _send(conn, REPLY, 0, 0, [], 0, True)
        return token

    def _answer(self, method_id: int, payload, peer, segment: Segment | None,
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

    def __init__(self, host: str, port: int, max_message_bytes: int, label: str, shared_memory: bool, *,
                 tls: ssl.SSLContext | None = None, token: str | None = None) -> None:
        self.address = f"{host}:{port}"
        self._host, self._port = host, port
        self.tls = tls  # a client SSLContext: the server must show a certificate for `host`
        self.max_message_bytes = max_message_bytes
        self.shared_memory = shared_memory
        self._token = token  # presented once per connection (an auth message), before any request
        self._sock: socket.socket | None = None
        self._segment: Segment | None = None
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
                write_parts(segment.requests, parts)
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
            if kind == REPLY_SHM and self._segment is not None and reply_size <= self._segment.capacity:
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
        if self._sock is not None and _peer_closed(self._sock):  # e.g. closed by the PS as idle
            log.info("%s: tensor stream was closed by the PS; reconnecting", self.address)
            self._drop()
        if self._sock is None:
            sock = socket.create_connection((self._host, self._port), timeout=max(0.001, deadline - time.monotonic()))
            _tune(sock)
            if self.tls is not None:  # the handshake runs under the call's deadline (the socket's timeout)
                sock = self.tls.wrap_socket(sock, server_hostname=self._host.strip("[]"))
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

    def _segment_for(self, sock: socket.socket, size: int) -> Segment | None:
        """The attached segment, (re)created with room for `size`; None if the PS cannot attach it."""
        if self._segment is not None and self._segment.capacity >= size:
            return self._segment
        capacity = max(2 * size, 1 << 20)
        segment, spec = Segment.create(capacity)
        try:
            body = json.dumps(spec).encode()
            _send(sock, ATTACH, 0, 0, [body], len(body), True)
            _, status, _, reply_size = _read_prefix(sock, self.max_message_bytes)
            reason = bytes(self._inbox.receive(sock, reply_size))
        except BaseException:
            segment.close()
            raise
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
