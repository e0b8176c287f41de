"""A worker's operations surface: its health (grpc.health.v1) and its Prometheus endpoint.

Health: the worker hosting the coordinator (the chief, or worker 0) serves it on the coordinator's
gRPC server; every other worker binds its own cluster address with a server that serves health and
nothing else, so that a Kubernetes gRPC probe has a port to ask on every pod. A worker whose address
cannot be bound logs a warning and trains on without it: a probe must not stop training. States:
NOT_SERVING until the worker joined the cluster, SERVING while it trains, NOT_SERVING from its
shutdown on (the chief's coordinator still answers the other workers meanwhile).

Metrics (`metrics_port` >= 0): the process's memory and CPU, this worker's step, the chief's
checkpoint durations and failures, and on the coordinator's host its calls and membership
(docs/operations.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from paramserver.base.config import NodeConfig, bind_address
from paramserver.base.errors import UnavailableError
from paramserver.base.lifecycle import Lifecycle, ReadyFlag
from paramserver.base.metrics import MetricsEndpoint, NodeMetrics
from paramserver.security.tls import TlsMaterial
from paramserver.transport.grpc_transport import health_server
from paramserver.transport.health import Health

log = logging.getLogger(__name__)


class WorkerOps(Lifecycle):
    """Health and metrics of one worker.

    Lifecycle (base/lifecycle.py): `start()` binds the health server (a worker not hosting the
    coordinator) and the metrics endpoint; `wait_ready(timeout)`: both serve once `start` returned;
    `set_serving()` once joined, `set_draining()` when it shuts down; `stop(grace)` joins their
    threads ("health-rpc_0", "metrics-http").
    """

    def __init__(
        self, config: NodeConfig, metrics: NodeMetrics, health: Health | None = None, tls: TlsMaterial | None = None
    ) -> None:
        """`health`: the one the coordinator's server serves (the host), or None to serve our own
        (over TLS with `tls`, as the node's other channels)."""
        self.name = f"worker {config.worker_index}"
        self.metrics = metrics
        self.health = health or Health()
        # an elastic run's worker that the cluster spec does not list has no address to serve health on
        listed = config.address
        serves = health is None and listed is not None
        self.health_server = health_server(self.health, bind_address(listed or ""), tls) if serves else None
        port = config.options.metrics_port
        self.endpoint = (
            MetricsEndpoint(metrics.registry, port, config.options.metrics_bind, self.name) if port >= 0 else None
        )
        self.ready = ReadyFlag(f"{self.name}'s health and metrics")

    def start(self) -> None:
        if self.health_server is not None:
            try:
                self.health_server.start()
            except UnavailableError as exc:
                log.warning("%s: no health service: %s", self.name, exc)
        if self.endpoint is not None:
            try:
                self.endpoint.start()
            except BaseException as exc:
                self.ready.fail(exc)
                raise
        self.ready.set()

    def wait_ready(self, timeout: float) -> None:
        self.ready.wait(timeout)

    def set_serving(self) -> None:
        self.health.set_serving()

    def set_draining(self) -> None:
        self.health.set_draining()

    def stop(self, grace: float = 1.0) -> None:
        self.ready.fail(UnavailableError(f"{self.name}'s health and metrics stopped"))
        self.health.set_draining()
        if self.health_server is not None:
            self.health_server.stop(grace)
        if self.endpoint is not None:
            self.endpoint.stop(grace)


class WorkerCollector(Collector):
    """This worker's step (`step_of()`, read at scrape time)."""

    def __init__(self, worker: int, step_of) -> None:
        self.worker = str(worker)
        self.step_of = step_of

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("paramserver_worker_step", "This worker's optimizer steps", labels=["worker"])
        family.add_metric([self.worker], self.step_of())
        yield family
