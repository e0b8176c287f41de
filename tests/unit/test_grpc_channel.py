"""GrpcChannel's error when nothing answers: it names what the channel talks to."""

import socket
import threading
import time

import pytest

from paramserver.base.errors import UnavailableError
from paramserver.coordinator.coordinator_service import SERVICE as COORDINATOR
from paramserver.server.shard import Shard
from paramserver.server.shard_service import ShardService
from paramserver.transport.grpc_transport import SERVICE as SHARD
from paramserver.transport.grpc_transport import GrpcChannel, GrpcServer


@pytest.fixture
def dead_address():
    """An address on 127.0.0.1 where nothing listens (the port stays bound, so nothing else takes it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize("service, kind", [(COORDINATOR, "coordinator"), (SHARD, "parameter server")])
def test_an_unreachable_peer_is_named_by_its_service(dead_address, service, kind):
    channel = GrpcChannel(dead_address, 1 << 20, service_name=service)
    try:
        with pytest.raises(UnavailableError) as caught:
            channel.wait_ready(0.2)
    finally:
        channel.close()
    assert str(caught.value).startswith(f"{kind} {dead_address} not reachable within 0.2s")


def test_a_peer_that_listens_late_is_reached_within_a_fraction_of_a_second():
    """gRPC's default waits 1 s (up to 120 s later on) after a refused connection before it tries
    again: a worker that asked before the coordinator listened lost that second at every start."""
    with socket.socket() as sock:  # bound, not listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        channel = GrpcChannel(address, 1 << 20, use_stream=False)
        reached: list[float] = []
        waiter = threading.Thread(target=lambda: (channel.wait_ready(10), reached.append(time.monotonic())),
                                  name="test-wait-ready")
        waiter.start()
        time.sleep(0.15)  # the first attempt was refused
    server = GrpcServer(ShardService(Shard(0)), address, 1 << 20)
    try:
        server.start()
        listening = time.monotonic()
        waiter.join(10)
        assert reached, "the channel never became ready"
        assert reached[0] - listening < 0.5, f"reached {reached[0] - listening:.2f}s after the peer listened"
    finally:
        channel.close()
        server.stop(0)
