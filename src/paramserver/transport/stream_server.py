"""The PS side of the tensor stream (wire format: stream.py): a thread per connection, each request
answered through dispatch.answer like a gRPC call.

Limits (Options): a single message longer than `max_message_bytes` is refused before any memory is
taken for it (longer requests come in parts, bounded in all by `max_payload_bytes`); a connection
without a request for `idle_timeout_s` is closed; at most `max_connections` connections are served
at once. A connection takes one of those slots only once it proved itself (stream_slots.py): with
a token store, by an accepted auth message (at most 4 KiB) within seconds of its accept; without,
by a well-formed first message. With TLS, each connection's thread runs the handshake first; with a
token store, nothing large is read and no segment attached before the connection's token. Every
refusal made here (not by the service) is audited: an oversized or malformed message, a large
message or an attach before a token, an oversized auth message, a failed TLS handshake, a
connection that did not prove itself in time or was displaced, one past max_connections.

Draining (`drain`, then `stop(grace)`): no connection is accepted and no new request taken from
then on, while the requests in flight (their prefix read: being received, served or answered) go
on and send their replies; `stop` waits for them, at most `grace` seconds, before it closes every
connection. A request read after the drain began is answered UNAVAILABLE and its connection closed
(not audited: nothing is wrong with it).
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time

import grpc

from paramserver.base.config import Options
from paramserver.base.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    MalformedFrameError,
    ParamServerError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)
from paramserver.base.lifecycle import Lifecycle, ReadyFlag
from paramserver.transport.dispatch import answer, introduce, needs_token, turned_away
from paramserver.transport.shared_memory import Segment, SegmentError
from paramserver.transport.stream import (
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
    wake,
)
from paramserver.transport.stream_slots import HANDSHAKE_S, AcceptFailures, Connection, Slots

log = logging.getLogger(__name__)
_ANONYMOUS_BYTES = 64 * 1024  # the most a PS that checks tokens reads from a connection before its token
_AUTH_BYTES = 4096  # the most an auth message may hold (a token is a few dozen bytes)
# requests whose float32 tensors are measured as they are received (their gradients' and initial values'
# checks then read nothing again: Inbox.receive_frame); the others' headers are not worth a second parse
_MEASURED = frozenset(METHODS.index(name) for name in ("PushPull", "Register"))
_REFUSE_TIMEOUT_S = 1.0  # longest send of a refusal to a connection that is not served


class StreamServer(Lifecycle):
    """Accepts tensor streams and answers each with `service.call`. A thread per connection.

    Lifecycle (base/lifecycle.py): the port is bound when built; `start()` starts the accepting
    thread ("ps-stream-accept") and returns the port; `wait_ready(timeout)`; `stop(grace)` closes
    the listener, lets the requests in flight finish and send their replies, closes every
    connection and joins the threads ("ps-stream-<peer port>"), at most `grace` seconds in all.
    `drain()` takes nothing new and lets the requests in flight finish (module docstring); `stop`
    drains first and waits for them at most `grace` seconds, then cuts what is left.
    A connection is pending until it proves itself (stream_slots.py): only admitted connections take
    one of `max_connections` slots. With `tls` (a server SSLContext), each connection's thread first
    runs the TLS handshake; `refused` counts the peers that failed it.
    The accepting thread never ends before `stop`: an accept that fails for want of file descriptors
    is logged and retried after a pause.
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
        handshake_s: float = HANDSHAKE_S,
    ) -> None:
        self.service = service
        self.max_message_bytes = max_message_bytes
        # a request or reply longer than max_message_bytes travels in parts; put together, at most this
        self.max_payload_bytes = max(max_payload_bytes, max_message_bytes)
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.handshake_s = handshake_s
        self.tls = tls
        self.refused = 0
        try:  # no SO_REUSEPORT: a port in use is an error here, never a second server sharing it
            self._listener = socket.create_server((host, port), backlog=128)
        except OSError as exc:
            raise UnavailableError(f"tensor stream cannot listen on {host}:{port}: {exc.strerror}") from None
        self.port = self._listener.getsockname()[1]
        self.ready = ReadyFlag(f"tensor stream on port {self.port}")
        self.slots = Slots(max_connections)
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)  # notified whenever a request in flight ends
        self._in_flight = 0  # requests whose prefix was read and whose reply is not sent yet
        self._stopping = threading.Event()  # draining or stopped: nothing new is taken
        self._listener_shut = threading.Event()  # the drain closed the listener: no connection is made
        self._stopped = False
        self._acceptor = threading.Thread(target=self._accept, name="ps-stream-accept", daemon=True)
        # every connection thread started (pruned as they end): one that left its slot lives on a moment
        self._serving: list[threading.Thread] = []

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

    @property
    def in_flight(self) -> int:
        """Requests whose prefix was read and whose reply is not sent yet."""
        return self._in_flight

    @property
    def draining(self) -> bool:
        """Whether the drain (or stop) began and closed the listener: nothing new is taken, and a new
        connection is refused (not left in the listener's backlog until its close resets it)."""
        return self._listener_shut.is_set()

    def drain(self) -> None:
        """Take no new connection or request from now on; the requests in flight go on (`stop`
        waits for them). Returns at once; idempotent."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            self.ready.fail(UnavailableError(f"tensor stream on port {self.port} stopped"))
            in_flight = self._in_flight
        self.slots.close()  # no connection is taken from now on
        shut(self._listener)  # wakes the accepting thread (a plain close does not, on Linux)
        self._listener_shut.set()
        log.info("tensor stream on port %d draining: %d requests in flight", self.port, in_flight)

    def stop(self, grace: float = 2.0) -> None:
        deadline = time.monotonic() + grace
        self.drain()
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            if not self._quiet.wait_for(lambda: self._in_flight == 0, max(0.0, deadline - time.monotonic())):
                log.warning(
                    "tensor stream on port %d: %d requests still in flight after %.1fs: cut off",
                    self.port,
                    self._in_flight,
                    grace,
                )
        connections = self.slots.close()  # the connections left (closed already: none is added)
        for connection in connections:
            wake(connection.sock)  # its thread wakes and closes it
        threads = [self._acceptor, *(c.thread for c in connections if c.thread is not None), *self._serving]
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join(max(0.0, deadline - time.monotonic()))

    def _accept(self) -> None:
        failing = AcceptFailures(self.port)
        while not self._stopping.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError as exc:
                if self._stopping.is_set():
                    return
                # out of descriptors (or kernel memory): the next accept may succeed once some close
                self._stopping.wait(failing.pause(exc))
                continue
            failing.recovered()
            self._take(conn, peer)

    def _take(self, conn: socket.socket, peer) -> None:
        """Serve an accepted connection as pending, or turn it away when every slot is in use."""
        try:
            tune(conn)
        except OSError:  # reset already
            conn.close()
            return
        connection = Connection(conn, peer, self.handshake_s)
        connection.thread = threading.Thread(
            target=self._serve, args=(connection,), name=f"ps-stream-{peer[1]}", daemon=True
        )
        taken, evicted = self.slots.arrive(connection)
        if evicted is not None:
            wake(evicted.sock)  # its thread wakes, audits, closes it and ends
        if not taken:
            if self.slots.closed:
                conn.close()
            else:
                self._turn_away(conn, peer)
            return
        self._serving = [thread for thread in self._serving if thread.is_alive()]
        self._serving.append(connection.thread)
        connection.thread.start()

    def _turn_away(self, conn: socket.socket, peer) -> None:
        """Answer a connection past max_connections with the reason, and close it."""
        reason = f"the PS serves {self.max_connections} tensor stream connections already (max_connections)"
        log.warning("tensor stream from %s refused: %d connections served already", peer, self.max_connections)
        turned_away(self.service, "StreamConnect", str(peer), ResourceExhaustedError(reason))
        try:
            conn.settimeout(_REFUSE_TIMEOUT_S)
            send_error(conn, grpc.StatusCode.RESOURCE_EXHAUSTED, 0, reason)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, connection: Connection) -> None:
        peer = connection.peer
        try:
            if self.tls is not None and not self._handshake(self.tls, connection):
                return
            inbox = Inbox()
            while True:
                timeout = self.idle_timeout_s if connection.admitted else connection.deadline - time.monotonic()
                if timeout <= 0:
                    raise TimeoutError
                connection.sock.settimeout(timeout)  # also bounds a request that stops half-way
                if not self.serve_one(connection.sock, peer, inbox, connection):
                    break
        except TimeoutError:
            if connection.admitted:
                log.info("tensor stream from %s closed: idle for %.0fs (idle_timeout_s)", peer, self.idle_timeout_s)
            else:
                self._refuse_pending(connection, DeadlineExceededError(self._unproven(f"in {self.handshake_s:.0f}s")))
        except (OSError, ConnectionError, MalformedFrameError) as exc:
            if connection.evicted:
                self._refuse_pending(connection, ResourceExhaustedError(self._unproven("before newer connections")))
            elif not self._stopping.is_set():
                log.info("tensor stream from %s closed: %s", peer, exc)
                if isinstance(exc, MalformedFrameError):  # e.g. not a tensor stream at all
                    turned_away(self.service, "StreamFrame", str(peer), exc)
        except Exception:
            log.exception("tensor stream from %s failed", peer)
        finally:
            self.slots.leave(connection)
            connection.sock.close()
            if connection.segment is not None:
                connection.segment.close()

    def _unproven(self, when: str) -> str:
        proof = "an accepted token" if needs_token(self.service) else "a first message"
        return f"the connection showed no {proof} {when}; closed"

    def _refuse_pending(self, connection: Connection, error: ParamServerError) -> None:
        """Log and audit a pending connection closed: its handshake deadline passed, or it was evicted."""
        log.info("tensor stream from %s closed: %s", connection.peer, error)
        turned_away(self.service, "StreamHandshake", str(connection.peer), error)

    def _admit(self, conn: socket.socket, method_id: int, state: Connection) -> bool:
        """Give a connection that proved itself an admitted slot; False (refused) when none is free."""
        if self.slots.admit(state):
            return True
        if state.evicted:
            return False
        reason = f"the PS serves {self.max_connections} tensor stream connections already (max_connections)"
        turned_away(self.service, "StreamConnect", str(state.peer), ResourceExhaustedError(reason))
        send_error(conn, grpc.StatusCode.RESOURCE_EXHAUSTED, method_id, reason)
        return False

    def _refuse(self, conn: socket.socket, peer, what: str, method_id: int, error: ParamServerError) -> None:
        """Answer a message refused before it was read (audited as `what`)."""
        log.warning("tensor stream from %s: %s refused: %s", peer, what, error)
        turned_away(self.service, what, str(peer), error)
        send_error(conn, error.code, method_id, str(error))

    def serve_one(self, conn: socket.socket, peer, inbox: Inbox, state: Connection) -> bool:
        """Read and answer one message (UNAVAILABLE once draining); False when the connection must close.
        Called by the connection's own thread only (a test may call it on a socket pair)."""
        kind, _, method_id, size = read_prefix(conn)
        with self._lock:
            draining = self._stopping.is_set()
            if not draining:
                self._in_flight += 1
        if draining:
            return self._refuse_draining(conn, state, (kind, method_id, size), inbox)
        try:
            return self._serve_message(conn, peer, inbox, state, (kind, method_id, size))
        finally:
            with self._lock:
                self._in_flight -= 1
                self._quiet.notify_all()

    def _refuse_draining(self, conn: socket.socket, state: Connection, prefix: tuple, inbox: Inbox) -> bool:
        """Answer a message read after the drain began UNAVAILABLE; False: its connection closes. Its
        inline bytes are read first (as many as it may send), so that closing does not reset the
        connection, which could lose the answer."""
        kind, method_id, size = prefix
        anonymous = state.token is None and needs_token(self.service)
        if kind & ~MORE in (REQUEST, ATTACH, AUTH) and size <= (
            _ANONYMOUS_BYTES if anonymous else self.max_message_bytes
        ):
            inbox.receive(conn, size)
        log.info("tensor stream from %s: %s refused: the PS is draining", state.peer, _method_name(method_id))
        error = UnavailableError(f"tensor stream on port {self.port} is draining: it takes no new requests")
        send_error(conn, error.code, method_id, str(error))
        return False

    def _serve_message(self, conn: socket.socket, peer, inbox: Inbox, state: Connection, prefix: tuple) -> bool:
        """Read the rest of one message whose prefix was read, and answer it; False when the connection must close."""
        kind, method_id, size = prefix
        error: ParamServerError
        if not state.admitted and not needs_token(self.service) and not self._admit(conn, method_id, state):
            return False  # without tokens, a well-formed prefix is all a connection can prove
        if size > self.max_message_bytes:  # refused before a byte of it is read or allocated
            error = ResourceExhaustedError(
                f"message of {size} bytes exceeds max_message_bytes {self.max_message_bytes}"
            )
            self._refuse(conn, peer, "StreamFrame", method_id, error)
            return False
        if kind == AUTH:
            state.token = self._authenticate(conn, size, inbox, state)
            return True
        if state.token is None and needs_token(self.service):
            if size > _ANONYMOUS_BYTES:  # not read: a caller without a token gets no memory
                error = UnauthenticatedError(f"a message of {size} bytes before an accepted token is not read")
                self._refuse(conn, peer, _method_name(method_id), method_id, error)
                return False
            if kind == ATTACH:
                inbox.receive(conn, size)
                error = UnauthenticatedError("shared memory needs an accepted token first")
                self._refuse(conn, peer, "StreamAttach", 0, error)
                return True
        if kind == ATTACH:
            state.segment = self._attach(conn, inbox.receive(conn, size), state.segment)
            return True
        segment = state.segment
        if kind == REQUEST_SHM and segment is not None and size <= segment.capacity:
            payload = (  # the worker can still write the segment
                inbox.copy_frame(segment.requests[:size])
                if method_id in _MEASURED
                else inbox.copy(segment.requests[:size])
            )
        elif kind == REQUEST:
            payload = inbox.receive_frame(conn, size) if method_id in _MEASURED else inbox.receive(conn, size)
        elif kind & MORE:
            payload = self._receive_parts(conn, (kind, 0, method_id, size), inbox, state)
            if payload is None:
                return False
        else:
            error = InvalidArgumentError(f"unexpected tensor stream message kind {kind} of {size} bytes")
            self._refuse(conn, peer, "StreamFrame", method_id, error)
            return False
        status, reply = self._answer(method_id, payload, peer, segment, state.token, state.outbox)
        if isinstance(reply, int):  # already written into the segment
            send(conn, REPLY_SHM, status, method_id, [], reply, False)
        elif len(reply) > self.max_message_bytes:
            self._send_parts(conn, status, method_id, reply, inbox, segment)
        else:
            send(conn, REPLY, status, method_id, [reply], len(reply), True)
        return True

    def _receive_parts(self, conn: socket.socket, first: tuple, inbox: Inbox, state: Connection):
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
            self._refuse(conn, state.peer, "StreamFrame", first[2], exc)
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

    def _handshake(self, tls: ssl.SSLContext, connection: Connection) -> bool:
        """Run the TLS handshake (within the connection's deadline); False (logged, counted, audited,
        closed) when the peer fails it or the connection was closed meanwhile."""
        try:
            secure = tls.wrap_socket(connection.sock, server_side=True, do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:  # reset before the handshake began
            log.info("tensor stream from %s closed before its TLS handshake: %s", connection.peer, exc)
            return False
        if not self.slots.swap(connection, secure):  # stop() or eviction shut the plain socket meanwhile
            secure.close()
            return False
        try:
            secure.settimeout(max(0.001, connection.deadline - time.monotonic()))
            secure.do_handshake()
        except (OSError, ValueError) as exc:  # ssl.SSLError and TimeoutError are OSErrors
            if connection.evicted:
                raise
            with self._lock:  # counted before the peer sees its connection end (stop() cuts handshakes too)
                if not self._stopping.is_set():
                    self.refused += 1
                    log.warning("tensor stream from %s refused: TLS handshake failed: %s", connection.peer, exc)
                    error = UnauthenticatedError(f"TLS handshake failed: {exc}")
                    turned_away(self.service, "StreamTLS", str(connection.peer), error)
            return False
        return True

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

    def _authenticate(self, conn: socket.socket, size: int, inbox: Inbox, state: Connection) -> str:
        """The connection's token, once the service accepted it (the connection is then admitted); a
        refused one, or no free slot, closes the connection."""
        if size > _AUTH_BYTES:  # not read
            self._refuse(
                conn, state.peer, "StreamAuth", 0, UnauthenticatedError(f"a token of {size} bytes is not a token")
            )
            raise ConnectionError("an oversized auth message")
        token = bytes(inbox.receive(conn, size)).decode(errors="replace")
        refused = introduce(self.service, token, str(state.peer))
        if refused is not None:
            send_error(conn, refused.code, 0, str(refused))
            raise ConnectionError(f"token refused: {refused}")
        if not state.admitted and not self._admit(conn, 0, state):
            raise ConnectionError("no free connection slot")
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


def _method_name(method_id: int) -> str:
    return METHODS[method_id] if method_id < len(METHODS) else "StreamFrame"
