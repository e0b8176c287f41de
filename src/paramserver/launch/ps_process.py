"""A PS process: one PSNode (node/ps_node.py) from start until SIGTERM / SIGINT or an admin's Shutdown.

Once ready (`PSNode.wait_ready`), `run_ps_node` prints one line ``PARAMSERVER_READY ps <index>
<host:port>`` to stdout: the launcher (or whoever started the process) reads it to learn that the
PS serves and on which port (it binds port 0).
"""

from __future__ import annotations

import logging
import resource
import signal
import sys
import threading

from ..base.config import Options
from ..base.lifecycle import RESTART_EXIT_CODE
from ..node.ps_node import PSNode

log = logging.getLogger(__name__)
READY_PREFIX = "PARAMSERVER_READY"


def run_ps_node(
    bind: str, index: int, options: Options, ready_timeout: float = 60.0, cluster_address: str | None = None
) -> int:
    """Serve until SIGTERM, SIGINT or an admin's Shutdown call, then drain within `drain_grace_s`;
    returns the process exit code.
    Call from the main thread.

    Once `wait_ready` passed, prints the ready line (module docstring): the one readiness signal a
    PS process gives the process that started it."""
    raise_open_file_limit()
    stopping, restart = threading.Event(), []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())

    def shutdown(restart_asked: bool) -> None:  # an admin's Shutdown (or the chief's restart) drains like SIGTERM
        restart.append(restart_asked)
        stopping.set()

    with PSNode(bind, index, options, cluster_address) as node:
        node.service.on_shutdown = shutdown
        node.wait_ready(ready_timeout)
        print(f"{READY_PREFIX} ps {index} {node.address}", flush=True)
        while not stopping.wait(1.0):
            pass
        node.drain(options.drain_grace_s)
    sys.stdout.flush()
    if any(restart):
        log.info("ps %d: exiting with %d for its restart loop (a roll-back)", index, RESTART_EXIT_CODE)
        return RESTART_EXIT_CODE
    return 0


def raise_open_file_limit() -> None:
    """Raise this process's soft limit of open files to its hard limit: every tensor-stream and gRPC
    connection holds a descriptor, and the soft default (often 1024) is easily reached by a PS that
    many workers, or many idle peers, connect to. Whatever the limit, running out only pauses the
    accepting of connections (transport/stream_slots.py)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # a hard limit of "unlimited" past the kernel's nr_open
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
        return
    log.info("open-file limit raised from %d to %d", soft, hard)
