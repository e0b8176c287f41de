"""A node's health, as the standard gRPC health service (grpc.health.v1) reports it.

Every node serves `grpc.health.v1.Health` on its gRPC port: a PS next to its shard service, the
chief next to the coordinator, a plain worker on its own cluster address (grpc_transport.health_server,
which serves nothing else). Kubernetes' gRPC probes and `grpc_health_probe` read it (docs/operations.md).

States: NOT_SERVING from the start until the node is ready (a PS restored its shard and serves; a
worker joined the cluster), then SERVING, then NOT_SERVING for good once it drains. The overall
status ("") and each named service move together.

Watch streams never hold up a drain: a status change is sent to each stream with no lock held
(gRPC runs a stream's end, e.g. a client that cancels, on the thread that also completes sends:
a send awaited under a lock that end needs never completed), and `set_draining` then cancels
every stream without waiting for any client. A Watch that starts while the node drains gets
NOT_SERVING and is cancelled at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserver.security.tls import TlsMaterial, open_channel

log = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNREACHABLE = "UNREACHABLE"  # what `check` says of a node that did not answer
SERVICE_UNKNOWN = "SERVICE_UNKNOWN"  # what `check` says of a service the node does not serve
SERVICE_UNKNOWN_STATUS = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN  # what Watch says of one
_TELL_S = 0.5  # how long a drain lets the Watch streams be told NOT_SERVING before it cancels them


@dataclass(eq=False)
class _Stream:
    """One Watch stream: how to send it a status, its call (to cancel it), and what it was sent last."""

    service: str
    send: Callable[[health_pb2.HealthCheckResponse], None]
    context: grpc.ServicerContext
    sent: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # one send at a time, latest status last


class _Servicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 Check and Watch; Watch does not hold a request thread (gRPC's non-blocking
    streams). No send happens under `_lock`, which a stream's end takes."""

    def __init__(self, services: tuple[str, ...]) -> None:
        self.services = services
        self._lock = threading.Lock()
        self.status = NOT_SERVING
        self.draining = False
        self._streams: set[_Stream] = set()

    def Check(self, request, context):
        if request.service not in self.services:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            return health_pb2.HealthCheckResponse()
        return health_pb2.HealthCheckResponse(status=self.status)

    def Watch(self, request, context, send_response_callback=None):
        stream = _Stream(request.service, send_response_callback, context)
        with self._lock:
            draining = self.draining
            if not draining:
                self._streams.add(stream)
        if not context.add_callback(lambda: self._forget(stream)):  # it ended already
            self._forget(stream)
        self.tell(stream)
        if draining:
            context.cancel()

    Watch.experimental_non_blocking = True  # type: ignore[attr-defined]  # gRPC passes send_response_callback

    def _forget(self, stream: _Stream) -> None:
        with self._lock:
            self._streams.discard(stream)

    def tell(self, stream: _Stream) -> None:
        """Send `stream` the current status, unless it was the last one sent."""
        with stream.lock:
            status = self.status if stream.service in self.services else SERVICE_UNKNOWN_STATUS
            if status != stream.sent:
                stream.send(health_pb2.HealthCheckResponse(status=status))
                stream.sent = status

    def set(self, status: int, draining: bool = False) -> list[_Stream]:
        """The new status (none after draining); returns the Watch streams to tell. With `draining`,
        the streams are handed over: none is kept."""
        with self._lock:
            if self.draining:
                return []
            self.status, self.draining = status, draining
            streams = list(self._streams)
            if draining:
                self._streams.clear()
        return streams


class Health:
    """The status of a node and of the services it serves. Thread-safe."""

    def __init__(self, services: tuple[str, ...] = ()) -> None:
        self.services = ("", *services)
        self.servicer = _Servicer(self.services)

    def add_to(self, server: grpc.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    def set_serving(self) -> None:
        """SERVING, unless the node drains already."""
        for stream in self.servicer.set(SERVING):
            self.servicer.tell(stream)

    def set_draining(self) -> None:
        """NOT_SERVING from now on, whatever is set later: load balancers and probes stop sending.
        The Watch streams are told (for at most `_TELL_S`, on a named thread) and then cancelled:
        none is awaited, whatever its client does. Returns within about `_TELL_S`."""
        streams = self.servicer.set(NOT_SERVING, draining=True)
        if not streams:
            return
        telling = threading.Thread(target=self._tell_all, args=(streams,), name="health-drain", daemon=True)
        telling.start()
        telling.join(_TELL_S)
        for stream in streams:
            stream.context.cancel()  # also ends a send still under way
        log.info("health: NOT_SERVING; cancelled %d Watch stream(s)", len(streams))

    def _tell_all(self, streams: list[_Stream]) -> None:
        for stream in streams:
            self.servicer.tell(stream)

    def status(self, service: str = "") -> str:
        """ "SERVING" or "NOT_SERVING", as a Check of `service` answers ("SERVICE_UNKNOWN": not ours)."""
        if service not in self.services:
            return SERVICE_UNKNOWN
        return health_pb2.HealthCheckResponse.ServingStatus.Name(self.servicer.status)


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
