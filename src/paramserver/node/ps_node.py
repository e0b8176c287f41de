"""A PS node: one shard served over gRPC and the tensor stream (node/ps_process.py runs it as a process).

Operations (docs/operations.md): the gRPC port also serves grpc.health.v1 (NOT_SERVING until
`wait_ready` passed, SERVING, NOT_SERVING once draining); with `metrics_port` >= 0 a Prometheus
endpoint serves the node's metrics (its port is logged). SIGTERM drains (at once, or after a
preemption's grace: node/ps_stop.py): health goes NOT_SERVING, calls in flight get `drain_grace_s`
seconds to finish, then the process exits 0.

Restarts (docs/recovery.md, "When a pod dies"): each PS process has a random `incarnation`, announced
in Hello, so that a worker or the chief can tell a restarted PS from the one it registered with; a
resuming one (a cluster's PS with a checkpoint_dir) accepts pushes only from workers that registered
with it (Shard.sessions). The chief's
roll-back asks a PS to restart (a Shutdown with `restart`): it drains and exits RESTART_EXIT_CODE,
for its restart loop to start it again from the latest checkpoint.

With a `table_memory_budget`, the PS's tables keep the rows beyond it on local disk, in a
subdirectory of `spill_dir` of its own (tables/tiered/tiers.py, docs/scaling.md): made at start (after the
stale ones a killed PS of the same index left are deleted), deleted by `stop`. When the spill store
fails (tables/tiered/spill_condition.py) the PS says so: health NOT_SERVING and a log line with the cause
(also in Hello's table description: "spill_state", "spill_error"). A full disk is NOT_SERVING
until a write succeeds again (rows in memory still answer meanwhile); a store that failed for good
(or a disk full for too long) calls `on_spill_failure(cause)`: node/ps_process.py then drains
the PS and exits with the code that makes its launcher recover the shard from its checkpoint.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable

from paramserver.base.config import Options
from paramserver.base.lifecycle import Lifecycle
from paramserver.base.metrics import MetricsEndpoint, NodeMetrics
from paramserver.checkpoint import shard_writer
from paramserver.security.auth import SHARD_ACTIONS, Guard
from paramserver.security.run_secret import RunSecret
from paramserver.security.tls import tls_from_options
from paramserver.server.shard import Shard
from paramserver.server.shard_metrics import ShardCollector
from paramserver.server.shard_service import ShardService
from paramserver.tables.limits import TableLimits
from paramserver.tables.table_store import TableStore
from paramserver.tables.tiered.spill_condition import FAILED, FULL
from paramserver.tables.tiered.tiers import Tiers
from paramserver.transport.grpc_transport import SERVICE, GrpcServer
from paramserver.transport.health import NOT_SERVING, Health
from paramserver.transport.stream import host_id
from paramserver.transport.stream_server import StreamServer

log = logging.getLogger(__name__)


class PSNode(Lifecycle):
    """One shard served over gRPC and the tensor stream.

    Lifecycle (base/lifecycle.py): `start()` returns the gRPC address; `wait_ready(timeout)`;
    `stop(grace)` from any thread: both servers take nothing new at once, calls in flight on gRPC
    and on the tensor stream get `grace` seconds to finish and reply, then what is left is cut;
    every thread of both servers is joined (bounded) before it returns.
    `drain(grace)`: health NOT_SERVING first, then `stop(grace)`, within about `grace` seconds.
    """

    def __init__(self, bind: str, index: int, options: Options, cluster_address: str | None = None) -> None:
        """`cluster_address`: where the cluster spec says this PS is (said in the log next to `bind`)."""
        options = options.for_machine()  # limits left at 0: a share of this machine's memory, read once here
        self.index = index
        self.cluster_address = cluster_address
        run_secret = RunSecret.from_options(options)  # read once: what answers the run's challenge (Prove)
        self.guard = Guard.from_options(options, f"ps-{index}", SHARD_ACTIONS)  # token store and audit log
        try:
            restore = _restore_source(options, self.guard)
        except BaseException:
            self.guard.close()
            raise
        limits = TableLimits(
            options.max_table_rows,
            options.max_table_memory_bytes,
            options.max_tiered_table_rows,
            options.max_gradient_magnitude,
        )
        try:
            tiers = spill_tiers(options, index)
        except BaseException:
            self.guard.close()
            raise
        tables = TableStore(index, options.max_table_ids, restore=restore, limits=limits, tiers=tiers)
        self.shard = Shard(index, wait_timeout_s=options.rpc_timeout_s, restore=restore, tables=tables)
        self.metrics = NodeMetrics()
        # None without a checkpoint_dir: Checkpoint is refused
        self.writes = shard_writer(options.checkpoint_dir, options.checkpoint_quantize, options.restore_non_finite)
        if self.writes is not None:
            self.writes.metrics = self.metrics.checkpoint_metrics()
        self.service = ShardService(self.shard, save_checkpoint=self.writes)
        self.service.guard = self.guard
        self.service.run_secret = run_secret
        if options.resume:  # a PS that may restart into a running cluster: pushes only from its own registrants
            self.shard.sessions = set()
        self.incarnation = secrets.token_hex(8)
        self.service.calls = self.metrics.calls(SERVICE, self.service.methods)
        self.metrics.registry.register(ShardCollector(self.shard, self.shard.tables))
        self.health = Health((SERVICE,))
        tls = tls_from_options(options)  # gRPC and the stream: TLS on both or on neither
        self.server = GrpcServer(
            self.service,
            bind,
            options.max_message_bytes,
            options.ps_threads,
            tls=tls,
            health=self.health,
            max_payload_bytes=options.max_payload_bytes,
        )
        host = bind.rsplit(":", 1)[0].strip("[]")
        self.stream = StreamServer(
            self.service,
            host,
            options.stream_port,
            options.max_message_bytes,
            options.idle_timeout_s,
            options.max_connections,
            None if tls is None else tls.server_context,
            options.max_payload_bytes,
        )
        self.endpoint = (
            MetricsEndpoint(self.metrics.registry, options.metrics_port, options.metrics_bind, f"ps {index}")
            if options.metrics_port >= 0
            else None
        )
        self.address: str | None = None
        self._stop_lock = threading.Lock()
        self._stopped = False
        self.tiers = tiers
        self.on_spill_failure: Callable[[str], None] | None = None  # set by whoever runs the node
        if tiers is not None:
            tiers.condition.listen(self._spill_changed)

    def _spill_changed(self, state: str, cause: str) -> None:
        """The spill store's state changed (any thread, a request's or the main one)."""
        if state == FULL:
            log.warning(
                "ps %d: health NOT_SERVING: the spill disk is full (%s)",
                self.index,
                cause,
                extra={"event": "spill_full"},
            )
            for stream in self.health.servicer.set(NOT_SERVING):  # a state it leaves again, unlike a drain
                self.health.servicer.tell(stream)
        elif state == FAILED:
            log.error(
                "ps %d: health NOT_SERVING: the spill store failed: %s; the PS stops, for its shard to be "
                "recovered from its checkpoint",
                self.index,
                cause,
                extra={"event": "spill_failed"},
            )
            for stream in self.health.servicer.set(NOT_SERVING):
                self.health.servicer.tell(stream)
            if self.on_spill_failure is not None:
                self.on_spill_failure(cause)
        else:
            log.warning("ps %d: health SERVING: %s", self.index, cause, extra={"event": "spill_ok"})
            self.health.set_serving()

    def check_spill(self) -> None:
        """Look at the spill directory and how long a full disk lasted (about once a second); a
        problem found is told as any other (`_spill_changed`)."""
        if self.tiers is not None:
            self.tiers.check()

    def start(self) -> str:
        self.service.announce.update(stream_port=self.stream.start(), host_id=host_id(), incarnation=self.incarnation)
        port = self.server.start()
        if self.endpoint is not None:
            self.endpoint.start()
        host = self.server.bind.rsplit(":", 1)[0]
        self.address = f"{'127.0.0.1' if host in ('', '[::]', '0.0.0.0') else host}:{port}"
        listening = f"{host}:{port}"
        log.info(
            "ps %d serving on %s%s (tensor stream on port %d%s)",
            self.index,
            listening,
            f", cluster address {self.cluster_address}"
            if self.cluster_address and self.cluster_address != listening
            else "",
            self.stream.port,
            "" if self.server.tls is None else ", mutual TLS" if self.server.tls.mutual else ", TLS",
            extra={"event": "ps_started"},
        )
        return self.address

    def wait_ready(self, timeout: float) -> None:
        """Both servers accept calls (a Hello announces the stream's port from then on)."""
        deadline = time.monotonic() + timeout
        self.stream.wait_ready(timeout)
        self.server.wait_ready(max(0.0, deadline - time.monotonic()))
        self.health.set_serving()  # the shard was restored (if resuming) before the servers started

    def drain(self, grace: float) -> None:
        """Stop taking work (health NOT_SERVING), let calls in flight finish within `grace`, stop."""
        started = time.monotonic()
        self.health.set_draining()
        log.info("ps %d draining: health NOT_SERVING, calls in flight get %.1fs", self.index, grace)
        self.stop(grace)
        log.info("ps %d drained in %.2fs", self.index, time.monotonic() - started)

    def stop(self, grace: float = 2.0) -> None:
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        started = time.monotonic()
        self.health.set_draining()
        if self.tiers is not None:  # calls that found the spill store failed are answered from now on
            self.tiers.condition.stopping.set()
        self.stream.drain()  # no new stream request from now on, as on gRPC; those in flight go on
        self.server.stop(grace)
        self.stream.stop(max(0.5, started + grace - time.monotonic()))  # both within about `grace`
        if self.endpoint is not None:
            self.endpoint.stop(0.5)
        self.guard.close()
        if self.writes is not None:  # a file still being written: its tables stay open until it ends (bounded)
            self.writes.close(max(0.5, started + grace - time.monotonic()))
        self.shard.tables.close()  # after the servers: no call is in flight (the spill files go)
        stats = self.shard.describe()
        took = time.monotonic() - started
        log.info(
            "ps %d stopped after %d updates from %d pushes, %d late pushes dropped (%.2fs)",
            self.index,
            stats["version"],
            stats["pushes"],
            stats["dropped_late"],
            took,
            extra={"event": "ps_stopped", "duration_s": round(took, 3)},
        )


def spill_tiers(options: Options, index: int) -> Tiers | None:
    """The tiers of PS `index` with a `table_memory_budget` (None without): its tables spill to a
    directory of its own (stale ones go first), and a disk full for `spill_full_grace_s` fails it."""
    budget = options.table_memory_budget
    return Tiers.create(budget, options.spill_dir, index, options.spill_full_grace_s) if budget else None


def _restore_source(options: Options, guard: Guard):
    """The checkpoint to start from with `resume`, or None (nothing to resume from: a fresh start).
    What the PS starts from is audited."""
    if not options.resume:  # Options made sure a resume has its checkpoint_dir
        return None
    from paramserver.checkpoint.restore import RestoreSource  # only a resuming PS loads safetensors and fsspec
    from paramserver.checkpoint.store import CheckpointStore

    started = time.monotonic()
    source = RestoreSource.latest(
        CheckpointStore(options.checkpoint_dir), options.restore_non_finite, contents=False
    )  # rows checked chunk by chunk as they load: a PS reads about its share (docs/checkpoints.md)
    if source is None:
        log.info("no complete checkpoint in %s: starting fresh", options.checkpoint_dir)
    else:
        took = time.monotonic() - started
        log.info(
            "resuming from %s (step %d) in %.2fs",
            source.name,
            source.step,
            took,
            extra={"event": "checkpoint_restored", "step": source.step, "duration_s": round(took, 3)},
        )
    if guard.audit is not None:
        detail = {
            "dir": options.checkpoint_dir,
            "checkpoint": source.name if source else None,
            "step": source.step if source else None,
        }
        guard.audit.record("Restore", "ok", "node", "", detail)
    return source
