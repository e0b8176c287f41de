"""A worker whose process dies is dropped from an elastic run at once: its long-poll heartbeat is cancelled
by its closed connection, the gRPC server sees the call inactive before its deadline, and the coordinator
counts the worker dead now instead of after the heartbeat timeout. In-process gRPC, no process started."""

from __future__ import annotations

import time

import grpc

from paramserver.coordinator.coordinator_service import SERVICE, CoordinatorService
from paramserver.coordinator.membership import Coordinator
from paramserver.transport.grpc_transport import GrpcServer
from paramserver.wire import codec


def heartbeat_then_cancel(port: int, worker: int) -> None:
    """A heartbeat held by the coordinator (a long poll), cancelled by its caller while it waits."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/{SERVICE}/Heartbeat").future(
            codec.encode({"worker": worker, "step": 3, "wait": 1.0}), timeout=30
        )
        time.sleep(0.3)
        call.cancel()


def serve(coordinator: Coordinator) -> GrpcServer:
    server = GrpcServer(CoordinatorService(coordinator), "127.0.0.1:0", 1 << 20, service_name=SERVICE)
    server.start()
    return server


def test_an_elastic_worker_whose_heartbeat_is_cancelled_is_gone_at_once_and_back_with_its_next():
    coordinator = Coordinator(3, heartbeat_timeout_s=60, elastic=True)
    for worker in (0, 1):
        coordinator.join(worker)
    server = serve(coordinator)
    try:
        heartbeat_then_cancel(server.port, 1)
        deadline = time.monotonic() + 5
        while coordinator.state(1) != "dead" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coordinator.state(1) == "dead", coordinator.view()  # not after 60 s: within the poll
        assert coordinator.newly_gone() == [(1, "its heartbeat's connection closed")]
        assert coordinator.state(0) == "training"
        coordinator.heartbeat(1, 4)  # it was alive after all: heard from again
        assert coordinator.state(1) == "training"
    finally:
        server.stop(0.5)


def test_a_fixed_run_and_a_worker_that_left_are_not_dropped_by_a_cancelled_heartbeat():
    fixed = Coordinator(2, heartbeat_timeout_s=60)
    elastic = Coordinator(2, heartbeat_timeout_s=60, elastic=True)
    for coordinator in (fixed, elastic):
        coordinator.join(0)
        coordinator.join(1)
    elastic.leave(1)  # a clean end closes its channel with a heartbeat in flight
    for coordinator, state in ((fixed, "training"), (elastic, "exited")):
        server = serve(coordinator)
        try:
            heartbeat_then_cancel(server.port, 1)
            time.sleep(1.5)  # the held heartbeat has returned by now
            assert coordinator.state(1) == state, coordinator.view()
            assert coordinator.newly_gone() == []
        finally:
            server.stop(0.5)


def test_only_a_held_heartbeat_once_cancelled_drops_a_worker():
    """A call refused by the caller's checks never reaches the held poll: cancelling it drops no one."""
    coordinator = Coordinator(2, heartbeat_timeout_s=60, elastic=True)
    coordinator.join(0)
    coordinator.join(1)
    coordinator.caller_gone(1)  # no heartbeat of worker 1 is held now
    assert coordinator.state(1) == "training" and coordinator.newly_gone() == []
