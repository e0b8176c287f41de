"""The worker side of the tensor stream (wire format: stream.py): one connection per shard, a call
sent and its reply read in the caller's thread."""

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
    MalformedFrameError,
    ParamServerError,
    ResourceExhaustedError,
    UnavailableError,
    error_for_status,
)
from paramserver.transport.channel import CallHandle
from paramserver.transport.shared_memory import Segment, write_parts
from paramserver.transport.stream import (
    ATTACH,
    AUTH,
    CODES,
    METHODS,
    MORE,
    REPLY,
    REPLY_SHM,
    REQUEST,
    REQUEST_SHM,
    Inbox,
    await_ack,
    peer_closed,
    read_prefix,
    receive_parts,
    send,
    send_parts,
    tune,
)
from paramserver.wire import codec

log = logging.getLogger(__name__)
_SHM_MIN_BYTES = 64 * 1024  # smaller messages go inline: not worth a segment
_OWNED_REPLY_BYTES = 1 << 20  # replies up to this size are returned as owned bytes, larger ones as views


class StreamCall(CallHandle):
    """A call sent on a tensor stream. Its reply is read by `wait` in the caller's thread (or by
    the next call on the stream, which then keeps an owned copy for this one)."""

    def __init__(self, client: StreamClient, describe: str, deadline: float, owned: bool) -> None:
        self._client, self.describe, self.deadline, self.owned = client, describe, deadline, owned
        self.reply: memoryview | bytes | None = None
        self.error: ParamServerError | None = None

    def done(self) -> bool:
        return self.reply is not None or self.error is not None

    def wait_sent(self, timeout: float) -> None:
        """The request was copied out before `call` returned: nothing to wait for."""

    # a reply may be a view, as CallHandle's doc says; its `-> bytes` stays until wire.codec.decode takes views
    def wait(self, timeout: float) -> memoryview | bytes:  # type: ignore[override]
        if not self.done():
            self._client.finish(self, min(self.deadline, time.monotonic() + timeout))
        if self.error is not None:
            raise self.error
        assert self.reply is not None  # finish() set a reply or an error
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

    def __init__(
        self,
        host: str,
        port: int,
        max_message_bytes: int,
        label: str,
        shared_memory: bool,
        *,
        tls: ssl.SSLContext | None = None,
        token: str | None = None,
        max_payload_bytes: int = Options.max_payload_bytes,
    ) -> None:
        self.address = f"{host}:{port}"
        self._host, self._port = host, port
        self.tls = tls  # a client SSLContext: the server must show a certificate for `host`
        self.max_message_bytes = max_message_bytes
        # longer requests and replies travel in parts (stream.send_parts); put together, at most this
        self.max_payload_bytes = max(max_payload_bytes, max_message_bytes)
        self.shared_memory = shared_memory
        self._token = token  # presented once per connection (an auth message), before any request
        self._sock: socket.socket | None = None
        self._segment: Segment | None = None
        self._inbox = Inbox()
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
        if size > self.max_payload_bytes:  # refused here: the PS would refuse it part-way
            raise ResourceExhaustedError(
                f"{self.address} {METHODS[method_id]}: request of {size} bytes exceeds "
                f"max_payload_bytes {self.max_payload_bytes}"
            )
        try:
            sock = self._connect(deadline)
            segment = self._segment_for(sock, size) if self.shared_memory and size >= _SHM_MIN_BYTES else None
            if size > self.max_message_bytes:
                self._send_parts(sock, method_id, parts, size, segment)
                return
            if segment is not None:
                write_parts(segment.requests, parts)
            send(sock, REQUEST_SHM if segment else REQUEST, 0, method_id, parts, size, segment is None)
        except (OSError, ConnectionError) as exc:
            raise self._broken(METHODS[method_id], exc) from None
        except ParamServerError:  # refused part-way: the PS closes the connection
            self._drop()
            raise

    def _send_parts(self, sock: socket.socket, method_id: int, parts: list, size: int, segment: Segment | None) -> None:
        chunk = self.max_message_bytes if segment is None else min(self.max_message_bytes, segment.capacity)
        send_parts(
            sock,
            (REQUEST, REQUEST_SHM),
            0,
            method_id,
            parts,
            size,
            chunk,
            None if segment is None else segment.requests,
            lambda: await_ack(sock, self._inbox, self.max_message_bytes),
        )

    def _receive(self, call: StreamCall, deadline: float) -> None:
        """Read the in-flight reply into `call`: owned bytes if small or `call.owned`, else a view
        valid until the next call on this client."""
        self._in_flight = None
        sock = self._sock
        if sock is None:  # never: a call is in flight only while the socket it was sent on is open
            raise UnavailableError(f"{call.describe}: the tensor stream is not connected")
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            kind, status, method_id, reply_size = read_prefix(sock, self.max_message_bytes)
            reply: memoryview | bytes
            if kind == REPLY_SHM and self._segment is not None and reply_size <= self._segment.capacity:
                reply = self._segment.replies[:reply_size]
            elif kind & MORE:
                shm = None if self._segment is None else self._segment.replies
                reply = receive_parts(
                    sock,
                    (kind, status, method_id, reply_size),
                    self._inbox,
                    (REPLY, REPLY_SHM),
                    shm,
                    self.max_message_bytes,
                    self.max_payload_bytes,
                )
                reply_size = len(reply)
            else:
                reply = self._inbox.receive(sock, reply_size)
            if call.owned or reply_size <= _OWNED_REPLY_BYTES:
                reply = bytes(reply)
        except (OSError, ConnectionError, MalformedFrameError) as exc:
            call.error = self._broken(call.describe, exc)
            return
        except ResourceExhaustedError as exc:  # a reply past max_payload_bytes: the rest is not read
            self._drop()
            call.error = ResourceExhaustedError(f"{call.describe}: {exc}")
            return
        if status:
            call.error = error_for_status(
                CODES.get(status, grpc.StatusCode.UNKNOWN), f"{call.describe}: {bytes(reply).decode(errors='replace')}"
            )
        else:
            call.reply = reply

    def _broken(self, what: str, exc: Exception) -> ParamServerError:
        self._drop()
        if isinstance(exc, socket.timeout):
            return DeadlineExceededError(f"{self.address} {what}: no reply before the deadline")
        return UnavailableError(f"{self.address} {what}: tensor stream failed: {exc}")

    def _connect(self, deadline: float) -> socket.socket:
        if self._sock is not None and peer_closed(self._sock):  # e.g. closed by the PS as idle
            log.info("%s: tensor stream was closed by the PS; reconnecting", self.address)
            self._drop()
        if self._sock is None:
            sock = socket.create_connection((self._host, self._port), timeout=max(0.001, deadline - time.monotonic()))
            tune(sock)
            if self.tls is not None:  # the handshake runs under the call's deadline (the socket's timeout)
                sock = self.tls.wrap_socket(sock, server_hostname=self._host.strip("[]"))
            if self._token:
                self._present_token(sock, self._token, deadline)
            self._sock = sock
        self._sock.settimeout(max(0.001, deadline - time.monotonic()))
        return self._sock

    def _present_token(self, sock: socket.socket, token: str, deadline: float) -> None:
        """Send the auth message and read its answer; a refusal closes the socket and is raised."""
        data = token.encode()
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            send(sock, AUTH, 0, 0, [data], len(data), True)
            _, status, _, size = read_prefix(sock, self.max_message_bytes)
            reason = bytes(self._inbox.receive(sock, size)).decode(errors="replace")
        except BaseException:
            sock.close()
            raise
        if status:
            sock.close()
            raise error_for_status(CODES.get(status, grpc.StatusCode.UNKNOWN), f"{self.address}: {reason}")

    def _segment_for(self, sock: socket.socket, size: int) -> Segment | None:
        """The attached segment, (re)created with room for `size`; None if the PS cannot attach it."""
        if self._segment is not None and self._segment.capacity >= min(size, self.max_message_bytes):
            return self._segment
        capacity = min(max(2 * size, 1 << 20), self.max_message_bytes)  # larger messages go in parts
        segment, spec = Segment.create(capacity)
        try:
            body = json.dumps(spec).encode()
            send(sock, ATTACH, 0, 0, [body], len(body), True)
            _, status, _, reply_size = read_prefix(sock, self.max_message_bytes)
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
