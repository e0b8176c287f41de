"""Free TCP ports for nodes that are told their port before they bind it.

A port found by binding port 0 comes from the ephemeral range (net.ipv4.ip_local_port_range), which
the kernel also hands to every outgoing connection: between the probe's close and the node's bind,
any connection on the machine may take it. A port below that range is never handed out implicitly,
so only a program that names it can take it. `free_port` picks one at random there and checks that
it binds on 127.0.0.1 and on every interface (a node may listen on either).

Thread-safe: one lock guards the ports already handed out, which the next picks in this process avoid.
"""

from __future__ import annotations

import collections
import errno
import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # below: well-known and registered services' ports, often held by a daemon
FALLBACK_EPHEMERAL = (32768, 60999)  # Linux's default, where the file cannot be read
_MIN_CHOICE = 1000  # fewer ports than this below the ephemeral range: take those above it
_TRIES = 200
_given: collections.deque[int] = collections.deque(maxlen=512)  # recent picks: not handed out twice
_lock = threading.Lock()


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral ports (inclusive), or Linux's default where `path` cannot be read."""
    try:
        low, high = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return FALLBACK_EPHEMERAL
    return low, high


def candidate_ports(path: Path = EPHEMERAL_RANGE_FILE) -> range:
    """The ports `free_port` chooses from: LOWEST up to the ephemeral range, else those above it."""
    low, high = ephemeral_range(path)
    below = range(LOWEST, min(low, 65536))
    if len(below) >= _MIN_CHOICE:
        return below
    above = range(max(high + 1, LOWEST), 65536)
    if len(above) >= _MIN_CHOICE:
        return above
    return range(LOWEST, 65536)  # the whole range is ephemeral: nothing avoids the race


def binds(port: int) -> bool:
    """Whether a TCP socket can bind `port` on 127.0.0.1 and on 0.0.0.0 right now (then closed)."""
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    return False
                raise
    return True


def free_port(path: Path = EPHEMERAL_RANGE_FILE) -> int:
    """A TCP port below the ephemeral range, free on 127.0.0.1 and on every interface right now,
    and not handed out recently by this process. OSError (EADDRINUSE) if none of those tried is."""
    ports = candidate_ports(path)
    with _lock:
        for _ in range(_TRIES):
            port = random.choice(ports)
            if port not in _given and binds(port):
                _given.append(port)
                return port
    raise OSError(errno.EADDRINUSE, f"no free TCP port among {_TRIES} tried in {ports.start}-{ports.stop - 1}")
