"""A PS process: one PSNode (node/ps_node.py) from start until SIGTERM / SIGINT or a Shutdown (an
admin's, or the chief's at the end of the run with `stop_ps_at_end`). A PS of a run that ends it
(`stop_ps_at_end`) with a `checkpoint_dir` serves on after its first signal, up to `preempt_grace_s`,
for the workers' preemption checkpoint (node/ps_stop.py).

Once ready (`PSNode.wait_ready`), `run_ps_node` prints one line ``PARAMSERVER_READY ps <index>
<host:port>`` to stdout: the launcher (or whoever started the process) reads it to learn that the
PS serves and on which port (it binds port 0).

Exit codes: 0 after a Shutdown or a signal (128 + the signal when the run ends its PS and a signal
came first); RESTART_EXIT_CODE (75) after a roll-back's restart; SPILL_FAILED_EXIT_CODE (74,
EX_IOERR) when its spill store failed (tables/tiered/spill_condition.py): the shard's state is lost and
its launcher (or restart loop) recovers it from the checkpoint as for a killed PS (partial
recovery: that shard alone; otherwise a roll-back of the cluster).
"""

from __future__ import annotations

import logging
import resource
import signal
import sys

from paramserver.base.config import Options
from paramserver.base.lifecycle import RESTART_EXIT_CODE
from paramserver.node.ps_node import PSNode
from paramserver.node.ps_stop import StopRequests, preemption_grace

log = logging.getLogger(__name__)
READY_PREFIX = "PARAMSERVER_READY"
SPILL_FAILED_EXIT_CODE = 74  # EX_IOERR: the spill store failed; recover this shard from its checkpoint


def run_ps_node(
    bind: str, index: int, options: Options, ready_timeout: float = 60.0, cluster_address: str | None = None
) -> int:
    """Serve until SIGTERM, SIGINT or an admin's Shutdown call (or, in a preemption, its grace: node/ps_stop.py),
    then drain within `drain_grace_s`; returns the process exit code.
    Call from the main thread.

    Once `wait_ready` passed, prints the ready line (module docstring): the one readiness signal a
    PS process gives the process that started it."""
    raise_open_file_limit()
    requests = StopRequests(index, preemption_grace(options))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: requests.signalled(signum))

    def shutdown(restart_asked: bool) -> None:  # a Shutdown (admin, or the chief: restart, end) drains like SIGTERM
        requests.stop("restart" if restart_asked else "end")

    with PSNode(bind, index, options, cluster_address) as node:
        node.service.on_shutdown = shutdown
        node.on_spill_failure = lambda cause: requests.stop("spill")
        node.wait_ready(ready_timeout)
        print(f"{READY_PREFIX} ps {index} {node.address}", flush=True)
        while not requests.wait(1.0):
            node.check_spill()  # a spill directory removed, a disk full for too long
        node.drain(options.drain_grace_s)
    sys.stdout.flush()
    return _exit_code(options, requests.causes, index)


def _exit_code(options: Options, causes: list[int | str], index: int) -> int:
    """RESTART_EXIT_CODE after a roll-back's restart (whatever else came), SPILL_FAILED_EXIT_CODE after
    its spill store failed; 0 after a Shutdown, or a
    signal; but when the run ends its PS (`stop_ps_at_end`) and a signal stopped this one first,
    128 + the signal: a Job then counts an evicted or deleted PS as failed and replaces it, not as done."""
    if "restart" in causes:
        log.info("ps %d: exiting with %d for its restart loop (a roll-back)", index, RESTART_EXIT_CODE)
        return RESTART_EXIT_CODE
    if "spill" in causes:  # its shard's state is lost: whatever stopped it too, it must be recovered
        log.warning("ps %d: exiting with %d: its spill store failed", index, SPILL_FAILED_EXIT_CODE)
        return SPILL_FAILED_EXIT_CODE
    first = causes[0] if causes else "end"
    if not options.stop_ps_at_end or not isinstance(first, int):
        return 0
    log.info("ps %d: stopped by %s before the run ended it", index, signal.Signals(first).name)
    return 128 + first


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
