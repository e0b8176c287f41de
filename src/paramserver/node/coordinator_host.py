"""The coordinator served over gRPC by the worker that hosts it (the chief, or worker 0)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from paramserver.base.config import Options, bind_address
from paramserver.base.errors import ParamServerError
from paramserver.base.lifecycle import Lifecycle
from paramserver.base.metrics import NodeMetrics
from paramserver.client.ps_client import PSClient, hello
from paramserver.coordinator.collector import CoordinatorCollector
from paramserver.coordinator.coordinator_service import SERVICE as COORDINATOR
from paramserver.coordinator.coordinator_service import CoordinatorService
from paramserver.coordinator.membership import Coordinator
from paramserver.security.auth import COORDINATOR_ACTIONS, Credentials, Guard
from paramserver.security.run_secret import RunSecret
from paramserver.transport.channel import ShardChannel
from paramserver.transport.grpc_transport import GrpcChannel, GrpcServer
from paramserver.transport.health import Health

log = logging.getLogger(__name__)


def channel_to(credentials: Credentials, address: str, options: Options, **kwargs) -> GrpcChannel:
    """A channel to `address` showing this node's TLS material and token."""
    return GrpcChannel(
        address,
        options.max_message_bytes,
        tls=credentials.tls,
        token=credentials.token,
        max_payload_bytes=options.max_payload_bytes,
        **kwargs,
    )


class CoordinatorHost(Lifecycle):
    """The coordinator served over gRPC by the worker that hosts it.

    Lifecycle (base/lifecycle.py): `start()` returns the address to reach it; `wait_ready(timeout)`;
    `wait_done(grace)` while workers may need it; `stop(grace)`. A named thread
    ("coordinator-watch") tells the shards of workers found dead (`tell_shards`), and calls
    `on_restart(reason)` when a shard is no longer the process it was (worker/recovery/rollback.py).
    """

    def __init__(
        self,
        num_workers: int,
        address: str,
        options: Options,
        credentials: Credentials | None = None,
        metrics: NodeMetrics | None = None,
    ) -> None:
        """`credentials`: the hosting worker's own (TLS, token), also used when it tells the shards of dead
        workers; `metrics`: the hosting worker's, which then records the coordinator's calls and membership."""
        self.address = address
        self.options = options
        self.credentials = credentials or Credentials()
        self.coordinator = Coordinator(num_workers, options.heartbeat_timeout_s, elastic=options.max_workers > 0)
        if options.checkpoint_dir:  # the data positions of the checkpoint resumed from come first
            self.coordinator.hold_data()
        self.guard = Guard.from_options(options, "coordinator", COORDINATOR_ACTIONS)  # token store and audit log
        service = CoordinatorService(self.coordinator, RunSecret.from_options(options))  # Prove: the run's secret
        service.guard = self.guard
        if metrics is not None:
            service.calls = metrics.calls(COORDINATOR, service.methods)
            metrics.registry.register(CoordinatorCollector(self.coordinator))
        self.health = Health((COORDINATOR,))  # the hosting worker's health too (worker/ops.py)
        self.server = GrpcServer(
            service,
            bind_address(address),
            options.max_message_bytes,
            max(8, 3 * num_workers + 2),  # each worker: a heartbeat and a barrier held (long polls), and a call
            COORDINATOR,
            self.credentials.tls,
            health=self.health,
        )
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

    def tell_shards(
        self,
        ps_addresses: list[str],
        incarnations: list[str | None] | None = None,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        """From now on, tell these shards of every worker found dead, so their waits fail at once; and
        watch that each stays the process of `incarnations` (else `on_restart(reason)`)."""
        channels: list[ShardChannel] = [
            channel_to(self.credentials, a, self.options, use_stream=False) for a in ps_addresses
        ]
        self.notices = PSClient(channels, self.options.rpc_timeout_s)
        self.incarnations, self.on_restart = list(incarnations or []), on_restart

    def _watch(self) -> None:
        while not self._stopping.is_set():
            # each heartbeat, or at once when a worker's connection closed (Coordinator.caller_gone)
            self.coordinator.gone_found.wait(self.options.heartbeat_s)
            self.coordinator.gone_found.clear()
            if self._stopping.is_set():
                return
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
        self.coordinator.gone_found.set()  # the watcher ends now
        self.server.stop(grace)
        if self._watcher.ident is not None:  # started
            self._watcher.join(grace + self.options.rpc_timeout_s)
        if self.notices is not None:
            self.notices.close()
        self.guard.close()
