"""Every long-lived thing has one shape (base/lifecycle.py): start, wait_ready, stop, or a `with`
block; and once stopped, no thread it started is alive and no process it started runs.

The verdicts wait on the threads' `join` and on the processes' exit, each with a generous bound;
no sleep decides anything."""

from __future__ import annotations

import pytest
from tests.lifecycle_cases import (
    ALL,
    SPAWNING,
    Case,
    make_case,
    nothing_left_behind,
    running_coordinator,
    shard_service,
    start_wait_ready_stop,
    warm_up_grpc,
    with_block,
)

from paramserver.base.errors import ParamServerError, UnavailableError
from paramserver.coordinator.coordinator_service import SERVICE as COORDINATOR
from paramserver.coordinator.coordinator_service import CoordinatorClient
from paramserver.transport.grpc_transport import GrpcChannel, GrpcServer


@pytest.fixture(scope="module")
def coordinator_server():
    with running_coordinator() as address:
        yield address


@pytest.fixture(scope="module", autouse=True)
def grpc_warmed_up(coordinator_server):
    warm_up_grpc(coordinator_server)


@pytest.fixture
def case(request, tmp_path, coordinator_server) -> Case:
    return make_case(request.param, tmp_path, coordinator_server)


@pytest.mark.parametrize("case", [name for name in ALL if name not in SPAWNING], indirect=True)
def test_start_wait_ready_stop_leaves_no_thread_and_no_process(case):
    start_wait_ready_stop(case)


@pytest.mark.parametrize("case", [name for name in ALL if name not in SPAWNING | {"LocalCluster"}], indirect=True)
def test_a_with_block_starts_and_stops(case):
    with_block(case)


@pytest.mark.parametrize("case", [name for name in ALL if name != "LocalCluster"], indirect=True)
def test_stop_before_start_is_allowed_and_wait_ready_then_fails(case):
    with nothing_left_behind(False):
        thing = case.make()
        thing.stop(1.0)
        with pytest.raises(ParamServerError, match="stopped"):
            thing.wait_ready(1.0)


def test_wait_ready_names_what_was_not_ready_and_why():
    dead = GrpcServer(shard_service(), "127.0.0.1:0", 1 << 20)
    port = dead.start()
    dead.stop(0.1)
    client = CoordinatorClient(GrpcChannel(f"127.0.0.1:{port}", 1 << 20, use_stream=False,
                                           service_name=COORDINATOR), 3, 5.0)
    with client:
        with pytest.raises(UnavailableError, match=r"worker 3's join to the coordinator .* not ready within "
                                                   r"2\.5s \(coordinator 127\.0\.0\.1:\d+ not reachable"):
            client.wait_ready(2.5)  # longer than one attempt to connect (1 s)
