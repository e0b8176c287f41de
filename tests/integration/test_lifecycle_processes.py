"""The lifecycle checks of tests/lifecycle_cases.py for the things that start processes (SPAWNING): once
stopped, no thread they started is alive and no process they started runs."""

import pytest
from tests.lifecycle_cases import (
    SPAWNING,
    Case,
    make_case,
    running_coordinator,
    start_wait_ready_stop,
    warm_up_grpc,
    with_block,
)


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


@pytest.mark.cluster
@pytest.mark.parametrize("case", sorted(SPAWNING), indirect=True)
def test_start_wait_ready_stop_leaves_no_thread_and_no_process(case):
    start_wait_ready_stop(case)


@pytest.mark.cluster
@pytest.mark.parametrize("case", sorted(SPAWNING - {"LocalCluster"}), indirect=True)
def test_a_with_block_starts_and_stops(case):
    with_block(case)
