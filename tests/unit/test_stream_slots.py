"""transport/stream_slots.py: pending connections hold no admitted slot, the oldest pending one makes
room for a new one, and accept failures pause without end."""

import errno
import socket

from paramserver.transport.stream_slots import AcceptFailures, Connection, Slots


def connection():
    return Connection(socket.socket(), ("127.0.0.1", 1), handshake_s=10.0)


def test_the_oldest_pending_connection_makes_room_and_only_proven_ones_take_slots():
    slots = Slots(max_connections=2, max_pending=3)
    pending = [connection() for _ in range(3)]
    assert all(slots.arrive(c) == (True, None) for c in pending)
    newest = connection()
    taken, evicted = slots.arrive(newest)
    assert taken and evicted is pending[0] and evicted.evicted
    assert not slots.admit(pending[0])  # displaced: it may not come back
    assert slots.admit(pending[1]) and slots.admit(pending[2])
    assert slots.counts() == (1, 2)
    assert not slots.admit(newest) and slots.counts() == (0, 2)  # every slot in use: refused, and forgotten
    assert slots.arrive(connection()) == (False, None)  # turned away at once while every slot is in use
    slots.leave(pending[1])
    late = connection()
    assert slots.arrive(late) == (True, None) and slots.admit(late)
    assert set(slots.close()) == {pending[2], late} and slots.arrive(connection()) == (False, None)
    for c in [*pending, newest, late]:
        c.sock.close()


def test_a_swap_after_eviction_or_close_is_refused():
    slots = Slots(max_connections=4, max_pending=1)
    first, second = connection(), connection()
    slots.arrive(first)
    slots.arrive(second)  # displaces the first
    tls = socket.socket()
    assert not slots.swap(first, tls) and first.sock is not tls
    assert slots.swap(second, tls) and second.sock is tls
    slots.close()
    other = socket.socket()
    assert not slots.swap(second, other)
    for sock in (first.sock, tls, other):
        sock.close()


def test_accept_failures_pause_longer_up_to_a_second_and_start_over_once_accept_works():
    failures = AcceptFailures(port=1234)
    pauses = [failures.pause(OSError(errno.EMFILE, "Too many open files")) for _ in range(10)]
    assert pauses[0] == 0.01 and pauses == sorted(pauses) and pauses[-1] == 1.0
    failures.recovered()
    assert failures.pause(OSError(errno.ENFILE, "Too many open files in system")) == 0.01
