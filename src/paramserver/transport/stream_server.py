"""The PS side of the tensor stream (wire format: stream.py): a thread per connection, each request
answered through dispatch.answer like a gRPC call.

Limits (Options): a single message longer than `max_message_bytes` is refused before any memory is
taken for it (longer requests come in parts, bounded in all by `max_payload_bytes`); a connection
without a request for `idle_timeout_s` is closed; at most `max_connections` connections are served
at once. With TLS, each connection's thread runs the handshake first; with a token store, nothing
large is read and no segment attached before the connection's token.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time

import grpc

from ..base.config import Options
from ..base.errors import MalformedFrameError, ParamServerError, UnauthenticatedError, UnavailableError
from ..base.lifecycle import Lifecycle, ReadyFlag
from .dispatch import answer, introduce, needs_token, turned_away
from .shared_memory import Segment, SegmentError
from .stream import (
    ATTACH,
    AUTH,
    METHODS,
    MORE,
    REPLY,
    REPLY_SHM,
    REQUEST,
    REQUEST_SHM,
    Inbox,
    await_ack,
    read_prefix,
    receive_parts,
    send,
    send_error,
    send_parts,
    shut,
    tune,
)

log = logging.getLogger(__name__)
_ANONYMOUS_BYTES = 64 * 1024  # the most a PS that checks tokens reads from a connection before its token
_REFUSE_TIMEOUT_S = 1.0  # longest send of a refusal to a connection that is not served
_HANDSHAKE_TIMEOUT_S = 10.0  # a TLS peer that stalls its handshake gives up its thread after this


class _Connection:
    """What a served connection has established: its attached segment and its accepted token."""

    def __init__(self) -> None:
        self.segment: Segment | None = None
        self.token: str | None = None
        self.outbox = Inbox()  # replies sent inline are joined here, in a buffer reused across requests


class StreamServer(Lifecycle):
    """Accepts tensor streams and answers each with `service.call`. A thread per connection.

    Lifecycle (base/lifecycle.py): the port is bound when built; `start()` starts the accepting
    thread ("ps-stream-accept") and returns the port; `wait_ready(timeout)`; `stop(grace)` closes
    the listener and every connection (a call being answered is cut off) and joins the threads
    ("ps-stream-<peer port>"), at most `grace` seconds in all.
    With `tls` (a server SSLContext), each connection's thread first runs the TLS handshake;
    `refused` counts the peers that failed it.
    """

    def __init__(
        self,
        service,
        host: str,
        port: int,
        max_message_bytes: int,
        idle_timeout_s: float = 300.0,
        max_connections: int = 256,
        tls: ssl.SSLContext | None = None,
        max_payload_bytes: int = Options.max_payload_bytes,
    ) -> None:
        self.service = service
        self.max_message_bytes = max_message_bytes
        # a request or reply longer than max_message_bytes travels in parts; put together, at most this
        self.max_payload_bytes = max(max_payload_bytes, max_message_bytes)
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
        shut(self._listener)  # wakes the accepting thread (a plain close does not, on Linux)
        for conn in connections:
            shut(conn)  # wakes a thread blocked reading it
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
            tune(conn)
            thread = threading.Thread(target=self._serve, args=(conn, peer), name=f"ps-stream-{peer[1]}", daemon=True)
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
            send_error(
                conn,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                0,
                f"the PS serves {self.max_connections} tensor stream connections already (max_connections)",
            )
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket, peer) -> None:
        if self.tls is not None:
            secure = self._handshake(self.tls, conn, peer)
            if secure is None:
                return
            conn = secure
        state = _Connection()
        inbox = Inbox()
        conn.settimeout(self.idle_timeout_s)  # also bounds a request that stops half-way
        try:
            while self._serve_one(conn, peer, inbox, state):
                pass
        except TimeoutError:
            log.info("tensor stream from %s closed: idle for %.0fs (idle_timeout_s)", peer, self.idle_timeout_s)
        except (OSError, ConnectionError, MalformedFrameError) as exc:
            if not self._stopping.is_set():
                log.info("tensor stream from %s closed: %s", peer, exc)
        except Exception:
            log.exception("tensor stream from %s failed", peer)
        finally:
            with self._lock:
                self._connections.pop(conn, None)
            conn.close()
            if state.segment is not None:
                state.segment.close()

    def _serve_one(self, conn: socket.socket, peer, inbox: Inbox, state: _Connection) -> bool:
        """Read and answer one message; False when the connection must close."""
        kind, _, method_id, size = read_prefix(conn)
        if size > self.max_message_bytes:  # refused before a byte of it is read or allocated
            send_error(
                conn,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                method_id,
                f"message of {size} bytes exceeds max_message_bytes {self.max_message_bytes}",
            )
            return False
        if kind == AUTH:
            state.token = self._authenticate(conn, size, inbox, peer)
            return True
        if state.token is None and needs_token(self.service):
            if size > _ANONYMOUS_BYTES:  # not read: a caller without a token gets no memory
                send_error(
                    conn, grpc.StatusCode.UNAUTHENTICATED, method_id, "the tensor stream needs an accepted token first"
                )
                return False
            if kind == ATTACH:
                inbox.receive(conn, size)
                send_error(conn, grpc.StatusCode.UNAUTHENTICATED, 0, "shared memory needs an accepted token first")
                return True
        if kind == ATTACH:
            state.segment = self._attach(conn, inbox.receive(conn, size), state.segment)
            return True
        segment = state.segment
        if kind == REQUEST_SHM and segment is not None and size <= segment.capacity:
            payload = inbox.copy(segment.requests[:size])  # the worker can still write the segment
        elif kind == REQUEST:
            payload = inbox.receive(conn, size)
        elif kind & MORE:
            payload = self._receive_parts(conn, (kind, 0, method_id, size), inbox, state)
            if payload is None:
                return False
        else:
            send_error(
                conn,
                grpc.StatusCode.INVALID_ARGUMENT,
                method_id,
                f"unexpected tensor stream message kind {kind} of {size} bytes",
            )
            return False
        status, reply = self._answer(method_id, payload, peer, segment, state.token, state.outbox)
        if isinstance(reply, int):  # already written into the segment
            send(conn, REPLY_SHM, status, method_id, [], reply, False)
        elif len(reply) > self.max_message_bytes:
            self._send_parts(conn, status, method_id, reply, inbox, segment)
        else:
            send(conn, REPLY, status, method_id, [reply], len(reply), True)
        return True

    def _receive_parts(self, conn: socket.socket, first: tuple, inbox: Inbox, state: _Connection):
        """A request sent in parts, put together; None (refused, the connection to close) when the parts
        do not make one request or exceed max_payload_bytes (before a token: 64 KiB in all)."""
        anonymous = state.token is None and needs_token(self.service)
        shm = state.segment.requests if state.segment is not None else None
        try:
            return receive_parts(
                conn,
                first,
                inbox,
                (REQUEST, REQUEST_SHM),
                shm,
                self.max_message_bytes,
                _ANONYMOUS_BYTES if anonymous else self.max_payload_bytes,
            )
        except ParamServerError as exc:  # MalformedFrameError, ResourceExhaustedError: nothing was dispatched
            log.warning("tensor stream request refused: %s", exc)
            send_error(conn, exc.code, first[2], str(exc))
            return None

    def _send_parts(
        self,
        conn: socket.socket,
        status: int,
        method_id: int,
        reply: bytes | memoryview,
        inbox: Inbox,
        segment: Segment | None,
    ) -> None:
        """A reply longer than max_message_bytes, in parts: through the segment when one is attached."""
        chunk = self.max_message_bytes if segment is None else min(self.max_message_bytes, segment.capacity)
        send_parts(
            conn,
            (REPLY, REPLY_SHM),
            status,
            method_id,
            [reply],
            len(reply),
            chunk,
            None if segment is None else segment.replies,
            lambda: await_ack(conn, inbox, self.max_message_bytes),
        )

    def _handshake(self, tls: ssl.SSLContext, conn: socket.socket, peer) -> ssl.SSLSocket | None:
        """The connection over TLS; None (logged, counted, closed) when the peer fails the handshake."""
        previous = conn.gettimeout()
        conn.settimeout(_HANDSHAKE_TIMEOUT_S)
        secure = None
        try:
            secure = tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            secure.do_handshake()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            with self._lock:  # counted before the peer sees its connection end (stop() cuts handshakes too)
                self._connections.pop(conn, None)
                if not self._stopping.is_set():
                    self.refused += 1
                    log.warning("tensor stream from %s refused: TLS handshake failed: %s", peer, exc)
                    turned_away(
                        self.service, "StreamTLS", str(peer), UnauthenticatedError(f"TLS handshake failed: {exc}")
                    )
            (conn if secure is None else secure).close()
            return None
        secure.settimeout(previous)
        with self._lock:  # from now on stop() must shut the TLS socket: the plain one was handed over to it
            thread = self._connections.pop(conn, None)
            if self._stopping.is_set():
                secure.close()
                return None
            if thread is not None:  # always: _accept registered the connection before starting its thread
                self._connections[secure] = thread
        return secure

    def _attach(self, conn: socket.socket, request: memoryview, old: Segment | None) -> Segment | None:
        try:
            spec = json.loads(bytes(request))
            if not isinstance(spec, dict):
                raise SegmentError("attach needs a JSON object")
            segment = Segment.attach(spec)
        except (ValueError, RecursionError, OSError, OverflowError) as exc:  # SegmentError is a ValueError
            send_error(conn, grpc.StatusCode.INVALID_ARGUMENT, 0, f"cannot attach shared memory: {exc}")
            return old
        if old is not None:
            old.close()
        send(conn, REPLY, 0, 0, [], 0, True)
        return segment

    def _authenticate(self, conn: socket.socket, size: int, inbox: Inbox, peer) -> str:
        """The connection's token, once the service accepted it; a refused one closes the connection."""
        if size > _ANONYMOUS_BYTES:
            send_error(conn, grpc.StatusCode.UNAUTHENTICATED, 0, f"a token of {size} bytes is not a token")
            raise ConnectionError("an oversized auth message")
        token = bytes(inbox.receive(conn, size)).decode(errors="replace")
        refused = introduce(self.service, token, str(peer))
        if refused is not None:
            send_error(conn, refused.code, 0, str(refused))
            raise ConnectionError(f"token refused: {refused}")
        send(conn, REPLY, 0, 0, [], 0, True)
        return token

    def _answer(
        self, method_id: int, payload, peer, segment: Segment | None, token: str | None, outbox: Inbox
    ) -> tuple[int, bytes | memoryview | int]:
        """(status, reply bytes) or, when the reply went into the segment, (0, its size)."""

        def sink(parts: list) -> memoryview | int:
            size = segment.write(parts) if segment is not None else None
            return outbox.gather(parts) if size is None else size

        if method_id >= len(METHODS):
            message = f"unknown tensor stream method id {method_id}"
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], message.encode()
        result = answer(self.service, METHODS[method_id], payload, str(peer), sink, token)
        return (0, result.reply) if result.ok else (result.code.value[0], result.reply.encode())
