"""A PS process: one PSNode (node/ps_node.py) from start until SIGTERM / SIGINT or an admin's Shutdown.

Once ready (`PSNode.wait_ready`), `run_ps_node` prints one line ``PARAMSERVER_READY ps <index>
<host:port>`` to stdout: the launcher (or whoever started the process) reads it to learn that the
PS serves and on which port (it binds port 0).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from ..base.config import Options
from ..base.lifecycle import RESTART_EXIT_CODE
from ..node.ps_node import PSNode

log = logging.getLogger(__name__)
READY_PREFIX = "PARAMSERVER_READY"


def run_ps_node(bind: str, index: int, options: Options, ready_timeout: float = 60.0) -> int:
    """Serve until SIGTERM, SIGINT or an admin's Shutdown call, then drain within `drain_grace_s`;
    returns the process exit code.
    Call from the main thread.

    Once `wait_ready` passed, prints the ready line (module docstring): the one readiness signal a
    PS process gives the process that started it."""
    stopping, restart = threading.Event(), []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())

    def shutdown(restart_asked: bool) -> None:  # an admin's Shutdown (or the chief's restart) drains like SIGTERM
        restart.append(restart_asked)
        stopping.set()

    with PSNode(bind, index, options) as node:
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
