"""A PS node: one shard served over gRPC, from start until SIGTERM / SIGINT.

Once ready (`PSNode.wait_ready`), `run_ps_node` prints one line ``PARAMSERVER_READY ps <index>
<host:port>`` to stdout: the launcher (or whoever started the process) reads it to learn that the
PS serves and on which port (it binds port 0).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time

from ..base.config import Options
from ..base.lifecycle import Lifecycle
from ..checkpoint import save_shard
from ..server.shard import Shard
from ..server.shard_service import ShardService
from ..server.table_store import TableStore
from ..transport.grpc_transport import GrpcServer
from ..transport.stream import StreamServer, host_id

log = logging.getLogger(__name__)
READY_PREFIX = "PARAMSERVER_READY"


class PSNode(Lifecycle):
    """One shard served over gRPC and the tensor stream.

    Lifecycle (base/lifecycle.py): `start()` returns the gRPC address; `wait_ready(timeout)`;
    `stop(grace)` from any thread: gRPC calls in flight get `grace` seconds, then the stream's
    connections are cut; every thread of both servers is joined (bounded) before it returns.
    """

    def __init__(self, bind: str, index: int, options: Options) -> None:
        self.index = index
        restore = _restore_source(options)
        self.shard = Shard(index, wait_timeout_s=options.rpc_timeout_s, restore=restore)
        self.service = ShardService(self.shard, TableStore(index, options.max_table_ids, restore=restore),
                                    save_checkpoint=save_shard)
        self.server = GrpcServer(self.service, bind, options.max_message_bytes, options.ps_threads)
        host = bind.rsplit(":", 1)[0].strip("[]")
        self.stream = StreamServer(self.service, host, options.stream_port, options.max_message_bytes)
        self.address: str | None = None
        self._stop_lock = threading.Lock()
        self._stopped = False

    def start(self) -> str:
        self.service.announce.update(stream_port=self.stream.start(), host_id=host_id())
        port = self.server.start()
        host = self.server.bind.rsplit(":", 1)[0]
        self.address = f"{'127.0.0.1' if host in ('', '[::]', '0.0.0.0') else host}:{port}"
        log.info("ps %d serving on %s (tensor stream on port %d)", self.index, self.address, self.stream.port,
                 extra={"event": "ps_started"})
        return self.address

    def wait_ready(self, timeout: float) -> None:
        """Both servers accept calls (a Hello announces the stream's port from then on)."""
        deadline = time.monotonic() + timeout
        self.stream.wait_ready(timeout)
        self.server.wait_ready(max(0.0, deadline - time.monotonic()))

    def stop(self, grace: float = 2.0) -> None:
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        started = time.monotonic()
        self.server.stop(grace)
        self.stream.stop(grace)
        stats = self.shard.describe()
        took = time.monotonic() - started
        log.info("ps %d stopped after %d updates from %d pushes, %d late pushes dropped (%.2fs)", self.index,
                 stats["version"], stats["pushes"], stats["dropped_late"], took,
                 extra={"event": "ps_stopped", "duration_s": round(took, 3)})


def _restore_source(options: Options):
    """The checkpoint to start from with `resume`, or None (nothing to resume from: a fresh start)."""
    if not options.resume:  # Options made sure a resume has its checkpoint_dir
        return None
    from ..checkpoint.restore import RestoreSource  # only a resuming PS loads safetensors and fsspec
    from ..checkpoint.store import CheckpointStore

    started = time.monotonic()
    source = RestoreSource.latest(CheckpointStore(options.checkpoint_dir))
    if source is None:
        log.info("no complete checkpoint in %s: starting fresh", options.checkpoint_dir)
    else:
        took = time.monotonic() - started
        log.info("resuming from %s (step %d) in %.2fs", source.name, source.step, took,
                 extra={"event": "checkpoint_restored", "step": source.step, "duration_s": round(took, 3)})
    return source


def run_ps_node(bind: str, index: int, options: Options, grace: float = 2.0, ready_timeout: float = 60.0) -> int:
    """Serve until SIGTERM or SIGINT; returns the process exit code. Call from the main thread.

    Once `wait_ready` passed, prints the ready line (module docstring): the one readiness signal a
    PS process gives the process that started it."""
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    with PSNode(bind, index, options) as node:
        node.wait_ready(ready_timeout)
        print(f"{READY_PREFIX} ps {index} {node.address}", flush=True)
        while not stopping.wait(1.0):
            pass
        node.stop(grace)
    sys.stdout.flush()
    return 0
