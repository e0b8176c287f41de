"""The tensor stream: a plain TCP connection per (worker, shard) for the bulk calls. This module holds
its wire format (prefix, kinds, reads and writes); stream_server.py serves it, stream_client.py calls it.

gRPC's Python binding spends 3-4x more CPU per byte than a socket on multi-megabyte
messages (docs/performance.md), and a push or pull moves megabytes every step. So the
bulk calls (Register, PushPull) travel on this stream, while gRPC keeps discovery and
Hello. A PS announces its stream port and host id in its Hello reply.

When worker and PS run on the same host, the worker attaches a shared-memory segment to
its stream (transport/shared_memory.py: a sealed memfd): requests are encoded straight into
the segment's first half (the PS copies each out before checking it) and replies written
into its second half, and only 16-byte prefixes cross the socket.

Limits (Options): no message is longer than `max_message_bytes`: a longer request or reply goes
as consecutive parts (kind | MORE, then a last part without the flag; `send_parts`,
`receive_parts`), put back together by the receiver before anything else sees it, in all at most
`max_payload_bytes`; a part in shared memory is acknowledged (kind 6) once copied out, before the
next one overwrites it. A single message declaring more than `max_message_bytes` is refused before
any memory is taken for it, and a receive buffer grows with the bytes that arrive, never ahead of them; a
connection without a request for `idle_timeout_s` is closed (the client notices before its
next call and reconnects); at most `max_connections` connections are served at once, a
further one is answered RESOURCE_EXHAUSTED and closed. A new connection has seconds to prove
itself (its auth message, or without tokens its first prefix) before it takes one of those
(stream_slots.py).

Message = 16-byte prefix ``<4sBBHQ``: magic b"PSTS", kind, status (a gRPC status code
value, 0 = OK), method id (index in METHODS), payload length; then the payload, unless the
kind says it lies in shared memory. Kinds: 0 request, 1 reply, 2 request in shared
memory, 3 reply in shared memory, 4 attach (payload: JSON {"pid", "fd", "capacity"}), 5 auth (payload:
the client's token, UTF-8, at most 4 KiB; sent once, first, on a connection to a PS that checks tokens: until it
is accepted, every request is refused UNAUTHENTICATED, nothing over 64 KiB is read and no segment
is attached; a refused token closes the connection), 6 acknowledgement of a part in shared memory
(no payload). A failed reply's payload is the UTF-8 error message.

With TLS (an `ssl.SSLContext` on both ends, security/tls.py), every connection starts with a TLS
handshake and carries the same messages inside it; a peer that fails the handshake (no
certificate, one from another CA, plaintext) is logged, counted (`StreamServer.refused`) and
closed before any message is read. Shared memory stays available: its attach message travels
inside the authenticated connection.
"""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import struct
from pathlib import Path

import grpc
import numpy as np

from paramserver.base import kernels
from paramserver.base.errors import MalformedFrameError, ResourceExhaustedError, error_for_status
from paramserver.transport.shared_memory import write_parts
from paramserver.wire.codec import float32_spans, header_bytes, split_parts

MAGIC = b"PSTS"
METHODS = ("Hello", "Register", "PushPull", "SetMode", "Leave", "RegisterTable", "Lookup", "Probe")
PREFIX = struct.Struct("<4sBBHQ")
REQUEST, REPLY, REQUEST_SHM, REPLY_SHM, ATTACH, AUTH, ACK = range(7)
MORE = 0x80  # kind flag: a part of a longer request or reply; the parts that follow complete it
CODES = {code.value[0]: code for code in grpc.StatusCode}
_SOCKET_BUFFER = 8 * 1024 * 1024
_HOT_BYTES = 256 * 1024  # the most of a frame received at once while its float32 tensors are measured
FIRST_CHUNK = 1 << 20  # a receive buffer grows from here as bytes arrive (a prefix alone proves nothing)
_TLS_COALESCE_BYTES = 64 * 1024  # TLS: parts up to this size share records (each sendall is a record)


def host_id() -> str:
    """Says who may share memory with whom: equal ids, same kernel (boot), same hostname, and the same
    PID and network namespaces. An opaque digest of those: it travels in Hello replies, and equality
    is all a peer needs (not the host's name, boot id or namespaces).

    The PID namespace because the PS opens the worker's segment as /proc/<its pid>/fd/<n>, a path
    that names another process (or none) in another PID namespace. The network namespace because
    a node in its own one stands for a host of its own (containers, tests/fault/test_multihost.py):
    its peers reach it over TCP, as they would another machine."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    where = "/".join([socket.gethostname(), boot, *(_namespace(kind) for kind in ("pid", "net"))])
    return hashlib.sha256(where.encode()).hexdigest()[:32]


def _namespace(kind: str) -> str:
    """This process's namespace of `kind` ("pid", "net") as `kind:inode`; `kind:?` where unreadable."""
    try:
        return f"{kind}:{os.stat(f'/proc/self/ns/{kind}').st_ino}"
    except OSError:
        return f"{kind}:?"


def shut(sock: socket.socket) -> None:
    """Shut a socket down both ways and close it: a thread blocked in accept or recv on it wakes."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected, or already closed
        pass
    sock.close()


def wake(sock: socket.socket) -> None:
    """Shut a socket down both ways without closing it: a thread blocked reading it wakes (and closes
    it). Closing it here instead would free its descriptor while that thread may still poll it, and
    the next accept could reuse the number."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected, or closed already
        pass


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)


class Inbox:
    """A receive buffer reused across messages (fresh multi-megabyte buffers cost page faults).

    What `receive` returns is valid until the next `receive`. Not thread-safe.
    """

    def __init__(self) -> None:
        self._buffer = bytearray(PREFIX.size)
        self._spans: dict[int, tuple[int, int]] = {}  # float32 tensors measured on arrival (kernels.note_measured)

    @property
    def capacity(self) -> int:
        """Bytes the buffer holds now: it grows only as a message's bytes arrive."""
        return len(self._buffer)

    def receive(self, sock: socket.socket, size: int, at: int = 0) -> memoryview:
        """`size` bytes from `sock`, stored from offset `at` (the parts before it are kept); the view
        covers [0, at + size). The buffer grows (doubling) only as the bytes arrive."""
        self._spans.clear()
        got, end = at, at + size
        while got < end:
            got = self._receive_some(sock, got, end)
        return memoryview(self._buffer)[:end]

    def _receive_some(self, sock: socket.socket, got: int, end: int) -> int:
        if got == len(self._buffer):
            self._grow(got, min(end, max(2 * got, FIRST_CHUNK)))
        n = sock.recv_into(memoryview(self._buffer)[got : min(end, len(self._buffer))])
        if n == 0:
            raise ConnectionError("peer closed the tensor stream")
        return got + n

    def _receive_hot(self, sock: socket.socket, got: int, end: int) -> int:
        """As _receive_some, at most _HOT_BYTES at once: each piece is measured right after it arrives."""
        if got == len(self._buffer):
            self._grow(got, min(end, max(2 * got, FIRST_CHUNK)))
        n = sock.recv_into(memoryview(self._buffer)[got : min(end, len(self._buffer), got + _HOT_BYTES)])
        if n == 0:
            raise ConnectionError("peer closed the tensor stream")
        return got + n

    def receive_frame(self, sock: socket.socket, size: int) -> memoryview:
        """A request frame of `size` bytes from `sock`, as `receive`; each float32 tensor of it is
        measured (its largest magnitude) piece by piece as its bytes arrive, so that the check of a
        pushed gradient needs no pass of its own later (kernels.note_measured)."""
        self._spans.clear()
        if kernels.KERNELS is None:
            return self.receive(sock, size)
        got, spans, measured, done = 0, None, {}, 0  # done: bytes of spans[0] measured so far
        most = 0
        while got < size:
            got = self._receive_hot(sock, got, size)
            if spans is None:
                head = header_bytes(memoryview(self._buffer)[:got])
                if head is None or got < min(head, size):
                    continue
                spans = float32_spans(memoryview(self._buffer)[:got], size)
            while spans and spans[0][0] < got:
                start, nbytes = spans[0]
                upto = min(start + nbytes, got) & ~3  # whole floats (start is 8-aligned)
                if upto > start + done:
                    most = max(most, kernels.max_abs_bits(self._address() + start + done, upto - start - done))
                    done = upto - start
                if done < nbytes:
                    break
                measured[start] = (nbytes, most)
                spans.pop(0)
                done, most = 0, 0
        self._publish(measured)
        return memoryview(self._buffer)[:size]

    def copy(self, source: memoryview, at: int = 0) -> memoryview:
        """A private copy of `source` (memory a peer may still write) from offset `at`, in the reused
        buffer (the bytes before `at` are kept); the view covers [0, at + len(source))."""
        self._spans.clear()
        end = at + len(source)
        if len(self._buffer) < end:
            self._grow(at, end if not at else max(end, 2 * len(self._buffer)))
        view = memoryview(self._buffer)[:end]
        view[at:] = source
        return view

    def copy_frame(self, source: memoryview) -> memoryview:
        """A private copy of the request frame `source` (memory a peer may still write), as `copy`; the
        copy of each float32 tensor also measures it (its largest magnitude), so that the check of a
        pushed gradient reads nothing again (kernels.note_measured). Header and layout are read from
        the private copy, never from `source`."""
        size = len(source)
        if kernels.KERNELS is None or size < PREFIX.size:
            return self.copy(source)
        view = self.copy(source[: PREFIX.size])  # the frame's prefix (shorter than this one), then its header
        head = header_bytes(view)
        if head is not None and len(view) < min(head, size):
            view = self.copy(source[len(view) : min(head, size)], at=len(view))
        if len(self._buffer) < size:
            self._grow(len(view), size)
        done, measured = len(view), {}
        view = memoryview(self._buffer)[:size]
        source_address = np.frombuffer(source, np.uint8).ctypes.data if size else 0
        for start, nbytes in float32_spans(view[:done], size):
            if start < done:
                continue
            view[done:start] = source[done:start]
            measured[start] = (
                nbytes,
                kernels.copy_max_abs_bits(source_address + start, self._address() + start, nbytes),
            )
            done = start + nbytes
        view[done:] = source[done:]
        self._publish(measured)
        return view

    def _address(self) -> int:
        return np.frombuffer(self._buffer, np.uint8).ctypes.data

    def _publish(self, measured: dict[int, tuple[int, int]]) -> None:
        address = self._address()
        self._spans = {address + start: entry for start, entry in measured.items()}
        kernels.note_measured(self._buffer, self._spans)

    def gather(self, parts: list) -> memoryview:
        """The parts joined in the reused buffer (a reply: a fresh multi-megabyte one costs page faults)."""
        self._spans.clear()
        views = [memoryview(part).cast("B") for part in parts]
        size = sum(len(view) for view in views)
        if len(self._buffer) < size:
            self._buffer = bytearray(size)
        write_parts(memoryview(self._buffer), views)
        return memoryview(self._buffer)[:size]

    def _grow(self, keep: int, size: int) -> None:
        self._spans.clear()
        grown = bytearray(size)
        grown[:keep] = memoryview(self._buffer)[:keep]
        self._buffer = grown


def send(sock: socket.socket, kind: int, status: int, method: int, parts: list, size: int, inline: bool) -> None:
    if isinstance(sock, ssl.SSLSocket):
        _send_tls(sock, PREFIX.pack(MAGIC, kind, status, method, size), parts if inline else [])
        return
    sock.sendall(PREFIX.pack(MAGIC, kind, status, method, size))
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


def read_prefix(sock: socket.socket, max_bytes: int | None = None) -> tuple[int, int, int, int]:
    """The next message's prefix; with `max_bytes`, a longer message is a MalformedFrameError."""
    prefix, got = bytearray(PREFIX.size), 0
    while got < PREFIX.size:  # a loop, not MSG_WAITALL: with a timeout set, recv may return part
        n = sock.recv_into(memoryview(prefix)[got:])
        if n == 0:
            raise ConnectionError("peer closed the tensor stream")
        got += n
    magic, kind, status, method, size = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise MalformedFrameError(f"tensor stream message does not start with {MAGIC!r}")
    if max_bytes is not None and size > max_bytes:
        raise MalformedFrameError(f"tensor stream message of {size} bytes exceeds the maximum {max_bytes}")
    return kind, status, method, size


def send_error(sock: socket.socket, code: grpc.StatusCode, method: int, text: str) -> None:
    message = text.encode()
    send(sock, REPLY, code.value[0], method, [message], len(message), True)


def peer_closed(sock: socket.socket) -> bool:
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


def send_parts(
    sock: socket.socket,
    kinds: tuple[int, int],
    status: int,
    method: int,
    parts: list,
    size: int,
    chunk_bytes: int,
    shm: memoryview | None = None,
    await_ack=None,
) -> None:
    """A message longer than max_message_bytes, as consecutive parts of at most `chunk_bytes`, each
    but the last flagged MORE. `kinds`: (inline kind, shared-memory kind). With `shm` (a segment's
    half, at least `chunk_bytes` long) each part is written there, and `await_ack()` waits until the
    peer copied it out before the next one overwrites it; else the parts go inline."""
    sent = 0
    for piece in split_parts(parts, chunk_bytes):
        length = sum(len(view) for view in piece)
        sent += length
        more = MORE if sent < size else 0
        if shm is None:
            send(sock, kinds[0] | more, status, method, piece, length, True)
            continue
        write_parts(shm, piece)
        send(sock, kinds[1] | more, status, method, [], length, False)
        if more:
            await_ack()


def receive_parts(
    sock: socket.socket,
    first: tuple[int, int, int, int],
    inbox: Inbox,
    kinds: tuple[int, int],
    shm: memoryview | None,
    max_bytes: int,
    max_total: int,
) -> memoryview:
    """A message sent by `send_parts`, put together in `inbox`; `first`: its first prefix (read already).

    Each part must be one of `kinds` (inline, or in `shm` and no longer than it) with the status and
    method of the first, and only the last lacks MORE; the total is checked against `max_total` before
    a part is read. Raises MalformedFrameError or ResourceExhaustedError (then the connection must close:
    the rest of the message is still on its way)."""
    kind, status, method, size = first
    got = 0
    while True:
        base, more = kind & ~MORE, kind & MORE
        if base not in kinds or (base == kinds[1] and (shm is None or size > len(shm))):
            raise MalformedFrameError(
                f"tensor stream part of kind {kind} and {size} bytes does not belong to a "
                f"message of kind {first[0] & ~MORE}"
            )
        if more and not size:
            raise MalformedFrameError("tensor stream message has an empty part")
        if got + size > max_total:
            raise ResourceExhaustedError(
                f"message of more than {got + size} bytes (in parts) exceeds max_payload_bytes {max_total}"
            )
        if base == kinds[1]:
            assert shm is not None  # a shared-memory part without a segment was refused above
            view = inbox.copy(shm[:size], at=got)
            if more:  # copied out: the peer may write the next part
                send(sock, ACK, 0, method, [], 0, True)
        else:
            view = inbox.receive(sock, size, at=got)
        got += size
        if not more:
            return view
        kind, part_status, part_method, size = read_prefix(sock, max_bytes)
        if (part_status, part_method) != (status, method):
            raise MalformedFrameError(
                f"tensor stream part of method {part_method} (status {part_status}) inside a "
                f"message of method {method} (status {status})"
            )


def await_ack(sock: socket.socket, inbox: Inbox, max_bytes: int) -> None:
    """Wait for the peer's ACK of a part in shared memory; a refusal instead is raised as its typed error."""
    kind, status, _, size = read_prefix(sock, max_bytes)
    if kind == ACK and not size:
        return
    if kind == REPLY and status:  # the PS refused the request part-way (and closes the connection)
        reason = bytes(inbox.receive(sock, size)).decode(errors="replace")
        raise error_for_status(CODES.get(status, grpc.StatusCode.UNKNOWN), reason)
    raise MalformedFrameError(f"tensor stream: expected the acknowledgement of a part, got kind {kind}")
