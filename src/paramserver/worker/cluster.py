"""Building a worker's Context: connections to the PS, the coordinator, the mode switcher."""

from __future__ import annotations

import logging
import os

import torch

from paramserver.base import omp_wait
from paramserver.base.config import NodeConfig, Options
from paramserver.base.consistency_spec import ConsistencySpec
from paramserver.base.errors import ParamServerError, RollbackError
from paramserver.base.grpc_fork import GRPC_FORK_SUPPORT_ENV, grpc_fork_handlers_on
from paramserver.base.metrics import NodeMetrics
from paramserver.client.ps_client import PSClient
from paramserver.coordinator.coordinator_service import SERVICE as COORDINATOR
from paramserver.coordinator.coordinator_service import CoordinatorClient
from paramserver.node.coordinator_host import CoordinatorHost, channel_to
from paramserver.node.in_process import in_process_coordinator, in_process_shards
from paramserver.security.auth import Credentials
from paramserver.transport.channel import ShardChannel
from paramserver.worker.context import Context
from paramserver.worker.modes import ModeSwitcher
from paramserver.worker.ops import WorkerCollector, WorkerOps
from paramserver.worker.progress import ProgressWriter
from paramserver.worker.recovery.partial import ShardRecovery, supported
from paramserver.worker.recovery.rollback import RollbackFlag, restarted_shard, roll_back_shards
from paramserver.worker.summaries import open_summaries

log = logging.getLogger(__name__)


def in_process_context(num_ps: int, torch_threads: int = 0) -> Context:
    """A cluster of `num_ps` shards in this process, this worker its only one. `torch_threads` > 0:
    torch's intra-op threads, unless the script changed them from torch's default already."""
    options = Options()
    if torch_threads > 0 and torch.get_num_threads() == _default_threads():
        torch.set_num_threads(torch_threads)
    if omp_wait.spinning_since_torch_loaded_first:
        log.info(
            "torch was imported before paramserver with no OpenMP wait policy set: idle torch threads spin and "
            "slow the steps while other processes use the cores. Import paramserver first, or set "
            "OMP_WAIT_POLICY=PASSIVE in the environment (docs/performance.md)"
        )
    client = PSClient(in_process_shards(num_ps), options.rpc_timeout_s, options.split_bytes)
    client.connect(options.connect_timeout_s)
    coordinator = CoordinatorClient(in_process_coordinator(), 0, options.rpc_timeout_s, options.heartbeat_s)
    _join(coordinator, options.connect_timeout_s)
    log.info("no cluster configured: running an in-process cluster with %d shard(s)", num_ps)
    return Context(
        0,
        1,
        num_ps,
        client,
        options,
        True,
        ProgressWriter(-1, 0),
        ModeSwitcher(client, 0, 1, barrier=coordinator.barrier),
        coordinator,
    )


def _default_threads() -> int:
    """torch's own thread count: OpenMP's default, the cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


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
        log.warning(
            "grpc was imported before paramserver, with %s unset: gRPC's fork handlers stay on in this "
            "process, and a DataLoader's forked worker processes may crash or hang. Import paramserver "
            "first, or set %s=0 in the environment (docs/configuration.md)",
            GRPC_FORK_SUPPORT_ENV,
            GRPC_FORK_SUPPORT_ENV,
        )
    if options.torch_threads > 0:
        torch.set_num_threads(options.torch_threads)
    workers = config.num_workers  # an elastic run's slots
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
    partial = supported(options)  # a PS that restarts restores its shard alone: the workers bring it back
    client.tolerate_lost = partial
    coordinator: CoordinatorClient | None = None
    try:  # a worker that cannot join stops what it started
        if host is not None:
            host.tell_shards(list(cluster.ps), client.incarnations, None if partial else rollback.flag)
        coordinator = CoordinatorClient(
            channel_to(credentials, coordinator_address, options, use_stream=False, service_name=COORDINATOR),
            index,
            options.rpc_timeout_s,
            options.heartbeat_s,
            rollback.flag,
        )
        _join(coordinator, options.connect_timeout_s)
        checkpointer, meet = _pauses(config, client, coordinator)
        if host is not None:
            _restore_data(host, checkpointer)
        modes = ModeSwitcher(
            client, index, workers, options.mode_changes, options.backup_workers, meet, options.max_workers > 0
        )
    except BaseException as exc:
        why = _rolled_back_while_joining(client, rollback, coordinator) if isinstance(exc, ParamServerError) else None
        if coordinator is not None:
            coordinator.stop(1.0, leave=why is None)  # one restarting after a roll-back is still awaited
        ops.stop()
        if host is not None:
            host.stop(1.0)
        client.close()
        if why is not None:
            raise RollbackError(f"worker {index}: the cluster rolled back while it joined: {why} ({exc})") from exc
        raise
    log.info(
        "worker %d of %d joined %d PS (%s); coordinator at %s",
        index,
        workers,
        client.num_shards,
        spec,
        coordinator_address,
    )
    metrics.registry.register(WorkerCollector(index, lambda: coordinator.step))
    if checkpointer is not None and index == 0:  # the chief writes checkpoints; the other workers only pause
        checkpointer.metrics = metrics.checkpoint_metrics()
    summaries = open_summaries(options.logdir, options.summary_every, index, client.record)
    ops.set_serving()
    context = Context(
        index,
        workers,
        client.num_shards,
        client,
        options,
        False,
        ProgressWriter(options.progress_fd, index),
        modes,
        coordinator,
        host,
        checkpointer,
        ops,
        summaries,
        rollback,
        address=config.address,
    )
    if partial:
        context.partial = ShardRecovery(context, _shard_channel(config, credentials), options.connect_timeout_s)
        if checkpointer is not None and index == 0:
            checkpointer.before_save.append(context.partial.before_checkpoint)
    return context


def _rolled_back_while_joining(client, rollback: RollbackFlag, coordinator: CoordinatorClient | None) -> str | None:
    """Why joining failed because a peer went away under it (a PS or the chief restarting), or None:
    a restart loop then starts this worker again, as after any roll-back, and it joins the new cluster.
    A coordinator that never answered is not one: its address may be wrong."""
    if rollback.reason is not None:
        return rollback.reason
    why = restarted_shard(client.channels, client.incarnations)
    if why is None and coordinator is not None and coordinator.incarnation is not None:
        why = coordinator.restarted()
    return why


def _restore_data(host: CoordinatorHost, checkpointer) -> None:
    """The chief: the data positions of the checkpoint the run resumed from go back to the coordinator,
    which records them in each checkpoint from now on (worker/dispatched.py)."""
    if checkpointer is None:
        host.coordinator.restore_data(None)
        return
    checkpointer.data_state = host.coordinator.data_state
    host.coordinator.restore_data(checkpointer.lineage.data)


def _shard_channel(config: NodeConfig, credentials: Credentials):
    """A function making a new channel to a shard (partial recovery: its process restarted)."""
    options = config.options

    def make(shard: int) -> ShardChannel:
        return channel_to(
            credentials,
            config.cluster.ps[shard],
            options,
            use_stream=options.use_stream,
            use_shared_memory=options.shared_memory,
        )

    return make


def _host_coordinator(
    config: NodeConfig, credentials: Credentials, metrics: NodeMetrics
) -> tuple[CoordinatorHost | None, str]:
    """(the coordinator this worker hosts, or None; the address to reach the coordinator)."""
    address = (config.cluster.chief or config.cluster.worker)[0]
    if config.worker_index != 0:
        return None, address
    host = CoordinatorHost(config.num_workers, address, config.options, credentials, metrics)
    return host, host.start()


def _connect_shards(config: NodeConfig, spec: ConsistencySpec, credentials: Credentials) -> PSClient:
    options = config.options
    channels: list[ShardChannel] = [
        _shard_channel(config, credentials)(shard) for shard in range(len(config.cluster.ps))
    ]
    client = PSClient(channels, options.rpc_timeout_s, options.split_bytes, config.worker_index, spec)
    client.connect(options.connect_timeout_s)
    client.pull_as = options.pull_as or None
    if options.compression_spec.auto:
        client.enable_auto(options.rpc_timeout_s)
    return client


def _pauses(config: NodeConfig, client: PSClient, coordinator: CoordinatorClient):
    """(the Checkpointer, or None without a checkpoint_dir; `meet(name, timeout)`, the barrier of
    the pauses for checkpoints and mode switches)."""
    options = config.options
    final: str | None = None  # checkpoints.FINAL, the final checkpoint's barrier name, with a checkpoint_dir
    checkpointer = None

    def meet(name: str, _timeout: float | None = None) -> None:
        """Out of every quorum first (a worker behind, e.g. one that started late, must reach the
        pause without waiting for those already there); then wait on membership, not on a
        deadline. Only the final checkpoint's waits for workers past their data too."""
        client.leave(options.rpc_timeout_s, barrier=name)
        between = None
        if checkpointer is not None and not name.startswith("checkpoint"):  # a mode switch's pause

            def between() -> None:
                if checkpointer.meet_announced(options.rpc_timeout_s):
                    client.leave(options.rpc_timeout_s, barrier=name)  # back at this one

        coordinator.barrier(name, training_only=not (final and name.startswith(final)), between=between)

    if options.checkpoint_dir:  # imported here: a worker that never checkpoints never loads fsspec
        from paramserver.checkpoint.store import CheckpointStore
        from paramserver.worker.recovery.checkpoints import FINAL as final
        from paramserver.worker.recovery.checkpoints import Checkpointer
        from paramserver.worker.recovery.lineage import Lineage

        store = CheckpointStore(options.checkpoint_dir)
        checkpointer = Checkpointer(
            client,
            store,
            options.checkpoint_every,
            options.checkpoint_keep,
            config.worker_index,
            meet,
            options.checkpoint_every_seconds,
            coordinator,
            in_step=options.dense_sync == "allreduce",
            base_every=options.checkpoint_base_every,
            allow_non_finite=options.restore_non_finite,
        )
        # the run's id and step, from the checkpoint the shards restored (after a roll-back: the one
        # they restored then, `client` being connected to the restarted shards)
        checkpointer.resumed(Lineage.of(store, [getattr(c, "hello", None) or {} for c in client.channels]))
    return checkpointer, meet
