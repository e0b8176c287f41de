"""GrpcChannel's error when nothing answers: it names what the channel talks to."""

import socket

import pytest

from paramserver.base.errors import UnavailableError
from paramserver.coordinator.coordinator_service import SERVICE as COORDINATOR
from paramserver.transport.grpc_transport import SERVICE as SHARD
from paramserver.transport.grpc_transport import GrpcChannel


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
