"""Which tensor-stream connections a PS serves: a connection is *pending* from accept until it proves
itself, then *admitted* (docs/security.md, "The tensor stream").

Proving itself: with a token store, an accepted auth message; without, a well-formed first message
prefix. A pending connection has `handshake_s` seconds from accept for that (its TLS handshake
included) and holds none of the `max_connections` slots admitted connections take; at most
`max_pending` connections are pending at once, and a new one closes the oldest (an idle peer cannot
keep a worker out: it is the first to go). So peers that never prove themselves, however many,
cannot take the slots workers need, and give up whatever they hold within seconds.

`AcceptFailures` paces the accepting thread when accept fails (out of file descriptors): it pauses
and retries, and never gives the port up.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections import OrderedDict

from paramserver.transport.shared_memory import Segment
from paramserver.transport.stream import Inbox

log = logging.getLogger(__name__)
MAX_PENDING = 64  # connections not yet proven, at once: a worker's proves itself within milliseconds
HANDSHAKE_S = 10.0  # from accept to a proven connection (TLS handshake and the first message)
_BACKOFF_S = (0.01, 1.0)  # accept failing for want of descriptors: first and longest pause before retrying
_ACCEPT_RETRY = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))


class Connection:
    """One accepted connection: its socket (the TLS one once wrapped), its peer, its thread, and what
    it has established (its token, its shared-memory segment)."""

    def __init__(self, sock: socket.socket, peer, handshake_s: float) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = time.monotonic() + handshake_s  # while pending
        self.admitted = False
        self.evicted = False  # closed to make room for a newer pending connection
        self.thread: threading.Thread | None = None
        self.segment: Segment | None = None
        self.token: str | None = None
        self.outbox = Inbox()  # replies sent inline are joined here, in a buffer reused across requests


class Slots:
    """Pending and admitted connections. Thread-safe."""

    def __init__(self, max_connections: int, max_pending: int = MAX_PENDING) -> None:
        self.max_connections = max_connections
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._pending: OrderedDict[Connection, None] = OrderedDict()  # oldest first
        self._admitted: set[Connection] = set()
        self._closed = False

    def arrive(self, connection: Connection) -> tuple[bool, Connection | None]:
        """(taken, evicted): whether `connection` is taken as pending (not when every admitted slot
        is in use, or after `close`), and the oldest pending connection it displaced, if any (the
        caller shuts that one; it is marked evicted)."""
        with self._lock:
            if self._closed or len(self._admitted) >= self.max_connections:
                return False, None
            evicted = None
            if len(self._pending) >= self.max_pending:
                evicted, _ = self._pending.popitem(last=False)
                evicted.evicted = True
            self._pending[connection] = None
            return True, evicted

    def admit(self, connection: Connection) -> bool:
        """Move a pending connection to an admitted slot; False when all are in use (or it was evicted)."""
        with self._lock:
            if connection not in self._pending or len(self._admitted) >= self.max_connections:
                self._pending.pop(connection, None)
                return False
            del self._pending[connection]
            self._admitted.add(connection)
            connection.admitted = True
            return True

    def swap(self, connection: Connection, sock: socket.socket) -> bool:
        """Serve `connection` on `sock` from now on (its TLS socket), so that `close` and eviction shut
        that one; False when it was closed or evicted meanwhile (the caller closes `sock`)."""
        with self._lock:
            if self._closed or connection.evicted:
                return False
            connection.sock = sock
            return True

    def leave(self, connection: Connection) -> None:
        with self._lock:
            self._pending.pop(connection, None)
            self._admitted.discard(connection)

    def close(self) -> list[Connection]:
        """Take no more connections; every one held now (to be shut by the caller)."""
        with self._lock:
            self._closed = True
            return [*self._pending, *self._admitted]

    @property
    def closed(self) -> bool:
        return self._closed

    def counts(self) -> tuple[int, int]:
        """(pending, admitted) now."""
        with self._lock:
            return len(self._pending), len(self._admitted)


class AcceptFailures:
    """Accept failing (out of file descriptors, kernel memory): one warning when it starts, growing
    pauses between tries, and one line when accepting works again."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.count, self.since, self.backoff = 0, 0.0, 0.0

    def pause(self, exc: OSError) -> float:
        """Seconds to wait before the next accept."""
        if not self.count:
            self.since = time.monotonic()
            retrying = "retrying" if exc.errno in _ACCEPT_RETRY else "unexpected; retrying"
            log.warning("tensor stream on port %d: accept failed: %s (%s with back-off)", self.port, exc, retrying)
        self.count += 1
        self.backoff = min(max(2 * self.backoff, _BACKOFF_S[0]), _BACKOFF_S[1])
        return self.backoff

    def recovered(self) -> None:
        if self.count:
            took = time.monotonic() - self.since
            log.warning(
                "tensor stream on port %d: accepting again after %d failed accepts in %.1fs",
                self.port,
                self.count,
                took,
            )
            self.count, self.backoff = 0, 0.0
