"""A node's health, as the standard gRPC health service (grpc.health.v1) reports it.

Every node serves `grpc.health.v1.Health` on its gRPC port: a PS next to its shard service, the
chief next to the coordinator, a plain worker on its own cluster address (grpc_transport.health_server,
which serves nothing else). Kubernetes' gRPC probes and `grpc_health_probe` read it (docs/operations.md).

States: NOT_SERVING from the start until the node is ready (a PS restored its shard and serves; a
worker joined the cluster), then SERVING, then NOT_SERVING for good once it drains. The overall
status ("") and each named service move together.
"""

from __future__ import annotations

import logging
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ..security.tls import TlsMaterial, open_channel

log = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNREACHABLE = "UNREACHABLE"  # what `check` says of a node that did not answer
SERVICE_UNKNOWN = "SERVICE_UNKNOWN"  # what `check` says of a service the node does not serve


class Health:
    """The status of a node and of the services it serves. Thread-safe."""

    def __init__(self, services: tuple[str, ...] = ()) -> None:
        self.services = ("", *services)
        self.servicer = health.HealthServicer(experimental_non_blocking=True)
        self._lock = threading.Lock()
        self._status = NOT_SERVING
        self._draining = False
        for service in self.services:
            self.servicer.set(service, NOT_SERVING)

    def add_to(self, server: grpc.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    def set_serving(self) -> None:
        """SERVING, unless the node drains already."""
        with self._lock:
            if self._draining:
                return
            self._status = SERVING
            for service in self.services:
                self.servicer.set(service, SERVING)

    def set_draining(self) -> None:
        """NOT_SERVING from now on, whatever is set later: load balancers and probes stop sending."""
        with self._lock:
            self._draining, self._status = True, NOT_SERVING
            self.servicer.enter_graceful_shutdown()

    def status(self, service: str = "") -> str:
        """ "SERVING" or "NOT_SERVING", as a Check of `service` answers ("SERVICE_UNKNOWN": not ours)."""
        if service not in self.services:
            return SERVICE_UNKNOWN
        with self._lock:
            return health_pb2.HealthCheckResponse.ServingStatus.Name(self._status)


def check(address: str, timeout: float, service: str = "", tls: TlsMaterial | None = None) -> str:
    """The health of the node at `address` ("SERVING", "NOT_SERVING"), SERVICE_UNKNOWN when it does
    not serve `service`, or UNREACHABLE when it did not answer within `timeout` seconds. `tls`: for
    a node that serves TLS."""
    with open_channel(address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError as exc:
            log.debug("health of %s: %s", address, exc)
            return SERVICE_UNKNOWN if exc.code() == grpc.StatusCode.NOT_FOUND else UNREACHABLE
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
