"""Building a worker's Context: connections to the PS, the coordinator, the mode switcher."""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from ..base.auth import COORDINATOR_ACTIONS, Credentials, Guard
from ..base.config import NodeConfig, Options, bind_address
from ..base.grpc_fork import GRPC_FORK_SUPPORT_ENV, grpc_fork_handlers_on
from ..base.consistency_spec import ConsistencySpec
from ..base.errors import ParamServerError
from ..base.lifecycle import Lifecycle
from ..base.metrics import NodeMetrics
from ..base.progress import ProgressWriter
from ..client.ps_client import PSClient
from ..coordinator.coordinator_service import SERVICE as COORDINATOR
from ..coordinator.coordinator_service import CoordinatorClient, CoordinatorService
from ..coordinator.membership import Coordinator
from ..server.shard import Shard
from ..server.shard_service import ShardService
from ..transport.grpc_transport import GrpcChannel, GrpcServer
from ..transport.health import Health
from ..transport.inprocess import InProcessChannel
from .context import Context
from .modes import ModeSwitcher
from .ops import CoordinatorCollector, WorkerCollector, WorkerOps
from .rollback import RollbackFlag, hello, roll_back_shards
from .summaries import open_summaries

log = logging.getLogger(__name__)


def _channel(credentials: Credentials, address: str, options: Options, **kwargs) -> GrpcChannel:
    """A channel to `address` showing this node's TLS material and token."""
    return GrpcChannel(address, options.max_message_bytes, tls=credentials.tls, token=credentials.token,
                       max_payload_bytes=options.max_payload_bytes, **kwargs)


class CoordinatorHost(Lifecycle):
    """The coordinator served over gRPC by the worker that hosts it.

    Lifecycle (base/lifecycle.py): `start()` returns the address to reach it; `wait_ready(timeout)`;
    `wait_done(grace)` while workers may need it; `stop(grace)`. A named thread
    ("coordinator-watch") tells the shards of workers found dead (`tell_shards`), and calls
    `on_restart(reason)` when a shard is no longer the process it was (worker/rollback.py).
    """

    def __init__(self, num_workers: int, address: str, options: Options, credentials: Credentials | None = None,
                 metrics: NodeMetrics | None = None) -> None:
        """`credentials`: the hosting worker's own (TLS, token), also used when it tells the shards of dead
        workers; `metrics`: the hosting worker's, which then records the coordinator's calls and membership."""
        self.address = address
        self.options = options
        self.credentials = credentials or Credentials()
        self.coordinator = Coordinator(num_workers, options.heartbeat_timeout_s)
        self.guard = Guard.from_options(options, "coordinator", COORDINATOR_ACTIONS)  # token store and audit log
        service = CoordinatorService(self.coordinator)
        service.guard = self.guard
        if metrics is not None:
            service.calls = metrics.calls(COORDINATOR, service.methods)
            metrics.registry.register(CoordinatorCollector(self.coordinator))
        self.health = Health((COORDINATOR,))  # the hosting worker's health too (worker/ops.py)
        self.server = GrpcServer(service, bind_address(address), options.max_message_bytes, max(8, 2 * num_workers),
                                 COORDINATOR, self.credentials.tls, health=self.health)
        self.notices: PSClient | None = None  # gRPC-only channels: a notice never queues behind a push
        self.incarnations: list[str | None] = []  # of the shards, as the chief registered with them
        self.on_restart: Callable[[str], None] | None = None
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="coordinator-watch", daemon=True)

    def start(self) -> str:
        """Serve; returns the address to reach it (the bound port, if the cluster spec said port 0)."""
        port = self.server.start()
        self._watcher.start()
        return f"127.0.0.1:{port}" if self.address.endswith(":0") else self.address

    def wait_ready(self, timeout: float) -> None:
        self.server.wait_ready(timeout)

    def tell_shards(self, ps_addresses: list[str], incarnations: list[str | None] | None = None,
                    on_restart: Callable[[str], None] | None = None) -> None:
        """From now on, tell these shards of every worker found dead, so their waits fail at once; and
        watch that each stays the process of `incarnations` (else `on_restart(reason)`)."""
        channels = [_channel(self.credentials, a, self.options, use_stream=False)
                    for a in ps_addresses]
        self.notices = PSClient(channels, self.options.rpc_timeout_s)
        self.incarnations, self.on_restart = list(incarnations or []), on_restart

    def _watch(self) -> None:
        while not self._stopping.wait(self.options.heartbeat_s):
            for worker, why in self.coordinator.newly_gone():
                log.warning("coordinator: worker %d is gone: %s", worker, why)
                if self.guard.audit is not None:
                    self.guard.audit.record("Gone", "ok", "coordinator", "", {"worker": worker, "why": why})
                if self.notices is not None:
                    self.notices.forget(worker, why, self.options.rpc_timeout_s)
            self._watch_shards()

    def _watch_shards(self) -> None:
        """A shard that answers as another process restarted: the cluster must roll back."""
        if self.notices is None or self.on_restart is None or not any(self.incarnations):
            return
        for index, channel in enumerate(self.notices.channels):
            try:
                now = hello(channel).get("incarnation")
            except ParamServerError:
                continue  # down: it says who it is once its restart loop started it again
            if self.incarnations[index] is not None and now != self.incarnations[index]:
                self.on_restart(f"ps {index} restarted (incarnation {self.incarnations[index]} is now {now})")
                return

    def wait_done(self, joining_grace_s: float) -> None:
        """Block while any worker may still need the coordinator (see Coordinator.all_done)."""
        self.coordinator.wait_all_done(joining_grace_s)

    def stop(self, grace: float = 1.0) -> None:
        """Idempotent. The watcher may be telling a shard of a dead worker: joined for at most
        `grace` + rpc_timeout_s."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.server.stop(grace)
        if self._watcher.ident is not None:  # started
            self._watcher.join(grace + self.options.rpc_timeout_s)
        if self.notices is not None:
            self.notices.close()
        self.guard.close()


def in_process_context(num_ps: int) -> Context:
    options = Options()
    channels = [InProcessChannel(ShardService(Shard(i))) for i in range(num_ps)]
    client = PSClient(channels, options.rpc_timeout_s, options.split_bytes)
    client.connect(options.connect_timeout_s)
    coordinator = CoordinatorClient(InProcessChannel(CoordinatorService(Coordinator(1)), "inprocess:coordinator"),
                                    0, options.rpc_timeout_s, options.heartbeat_s)
    _join(coordinator, options.connect_timeout_s)
    log.info("no cluster configured: running an in-process cluster with %d shard(s)", num_ps)
    return Context(0, 1, num_ps, client, options, True, ProgressWriter(-1, 0),
                   ModeSwitcher(client, 0, 1, barrier=coordinator.barrier), coordinator)


def _join(coordinator: CoordinatorClient, timeout: float) -> None:
    """Start the coordinator client and wait until it joined; stopped again if it did not."""
    coordinator.start()
    try:
        coordinator.wait_ready(timeout)
    except BaseException:
        coordinator.stop(1.0)
        raise


def cluster_context(config: NodeConfig) -> Context:
    """Join the cluster of `config` as a worker (worker 0, or the chief, hosts the coordinator)."""
    options, cluster, index = config.options, config.cluster, config.worker_index
    if grpc_fork_handlers_on:
        log.warning("grpc was imported before paramserver, with %s unset: gRPC's fork handlers stay on in this "
                    "process, and a DataLoader's forked worker processes may crash or hang. Import paramserver "
                    "first, or set %s=0 in the environment (docs/configuration.md)",
                    GRPC_FORK_SUPPORT_ENV, GRPC_FORK_SUPPORT_ENV)
    if options.torch_threads > 0:
        torch.set_num_threads(options.torch_threads)
    workers = cluster.num_workers
    credentials = Credentials.from_options(options)  # files read once; the token is presented on every call
    metrics = NodeMetrics()
    rollback = RollbackFlag(max(10.0, 2 * options.heartbeat_s))
    spec = options.consistency(workers)
    client = _connect_shards(config, spec, credentials)
    try:
        # with checkpoints, a chief that finds PS holding state restarted: it rolls them back (without, it adopts)
        if index == 0 and options.checkpoint_dir and roll_back_shards(client.channels, options.connect_timeout_s):
            client.close()  # the shards restarted: new processes, new streams
            client = _connect_shards(config, spec, credentials)
        host, coordinator_address = _host_coordinator(config, credentials, metrics)
    except BaseException:
        client.close()
        raise
    ops = WorkerOps(config, metrics, host.health if host is not None else None, credentials.tls)
    ops.start()
    try:  # a worker that cannot join stops what it started
        if host is not None:
            host.tell_shards(list(cluster.ps), client.incarnations, rollback.flag)
        coordinator = CoordinatorClient(_channel(credentials, coordinator_address, options, use_stream=False,
                                                 service_name=COORDINATOR),
                                        index, options.rpc_timeout_s, options.heartbeat_s, rollback.flag)
        _join(coordinator, options.connect_timeout_s)
        checkpointer, meet = _pauses(config, client, coordinator)
        modes = ModeSwitcher(client, index, workers, options.mode_changes, options.backup_workers, meet)
    except BaseException:
        ops.stop()
        if host is not None:
            host.stop(1.0)
        client.close()
        raise
    log.info("worker %d of %d joined %d PS (%s); coordinator at %s", index, workers, client.num_shards, spec,
             coordinator_address)
    metrics.registry.register(WorkerCollector(index, lambda: coordinator.step))
    if checkpointer is not None:
        checkpointer.metrics = metrics.checkpoints
    summaries = open_summaries(options.logdir, options.summary_every, index, client.record)
    ops.set_serving()
    return Context(index, workers, client.num_shards, client, options, False,
                   ProgressWriter(options.progress_fd, index), modes, coordinator, host, checkpointer, ops,
                   summaries, rollback, address=config.address)


def _host_coordinator(config: NodeConfig, credentials: Credentials,
                      metrics: NodeMetrics) -> tuple[CoordinatorHost | None, str]:
    """(the coordinator this worker hosts, or None; the address to reach the coordinator)."""
    address = (config.cluster.chief or config.cluster.worker)[0]
    if config.worker_index != 0:
        return None, address
    host = CoordinatorHost(config.cluster.num_workers, address, config.options, credentials, metrics)
    return host, host.start()


def _connect_shards(config: NodeConfig, spec: ConsistencySpec, credentials: Credentials) -> PSClient:
    options = config.options
    channels = [_channel(credentials, address, options, use_stream=options.use_stream,
                         use_shared_memory=options.shared_memory) for address in config.cluster.ps]
    client = PSClient(channels, options.rpc_timeout_s, options.split_bytes, config.worker_index, spec)
    client.connect(options.connect_timeout_s)
    return client


def _pauses(config: NodeConfig, client: PSClient, coordinator: CoordinatorClient):
    """(the Checkpointer, or None without a checkpoint_dir; `meet(name, timeout)`, the barrier of
    the pauses for checkpoints and mode switches)."""
    options, final = config.options, None
    checkpointer = None

    def meet(name: str, _timeout: float | None = None) -> None:
        """Out of every quorum first (a worker behind, e.g. one that started late, must reach the
        pause without waiting for those already there); then wait on membership, not on a
        deadline. Only the final checkpoint's waits for workers past their data too."""
        client.leave(options.rpc_timeout_s, barrier=name)
        coordinator.barrier(name, training_only=not (final and name.startswith(final)))

    if options.checkpoint_dir:  # imported here: a worker that never checkpoints never loads fsspec
        from ..checkpoint.store import CheckpointStore
        from .checkpoints import FINAL as final
        from .checkpoints import Checkpointer

        checkpointer = Checkpointer(client, CheckpointStore(options.checkpoint_dir), options.checkpoint_every,
                                    options.checkpoint_keep, config.worker_index, meet,
                                    options.checkpoint_every_seconds, coordinator)
    return checkpointer, meet
