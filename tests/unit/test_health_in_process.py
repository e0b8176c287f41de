"""grpc.health.v1 on nodes in this process: a PS is NOT_SERVING until ready, a drain lets a call in flight
finish after health went NOT_SERVING, and a worker whose address is taken trains on without a health
service. The operations surface of real node processes: tests/integration/test_operations.py."""

import socket
import threading
import time

import grpc
from tests.prometheus_samples import scrape

from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task
from paramserver.base.metrics import NodeMetrics
from paramserver.node.ps_node import PSNode
from paramserver.transport.health import check
from paramserver.wire import codec
from paramserver.worker.ops import WorkerOps

BOUND_S = 120  # generous: a loaded 2-core machine is slow; never reached by a passing test


# ---- health ---------------------------------------------------------------------------------------
def test_ps_health_is_not_serving_until_ready():
    node_ = PSNode("127.0.0.1:0", 0, Options())
    try:
        address = node_.start()
        assert check(address, 10) == "NOT_SERVING"
        assert check(address, 10, "paramserver.Shard") == "NOT_SERVING"
        node_.wait_ready(30)
        assert check(address, 10) == "SERVING"
        assert check(address, 10, "paramserver.Shard") == "SERVING"
        assert check(address, 10, "no.such.Service") == "SERVICE_UNKNOWN"  # NOT_FOUND: not a service of a PS
    finally:
        node_.stop(1.0)


def test_a_drain_lets_a_call_in_flight_finish_after_health_went_not_serving():
    node_ = PSNode("127.0.0.1:0", 0, Options())
    address = node_.start()
    node_.wait_ready(30)
    entered, release, seen = threading.Event(), threading.Event(), []
    hello = node_.service.methods["Hello"]

    def slow_hello(request, tensors, sink):  # a call that is still being answered when the drain starts
        entered.set()
        release.wait(BOUND_S)
        seen.append(node_.health.status())
        return hello(request, tensors, sink)

    node_.service.methods["Hello"] = slow_hello
    drainer = threading.Thread(target=node_.drain, args=(BOUND_S,), name="test-drain")
    with grpc.insecure_channel(address) as channel:
        try:
            call = channel.unary_unary("/paramserver.Shard/Hello").future(codec.encode({}), timeout=BOUND_S)
            assert entered.wait(BOUND_S)
            drainer.start()
            deadline = time.monotonic() + BOUND_S
            while node_.health.status() != "NOT_SERVING" and time.monotonic() < deadline:
                time.sleep(0.01)  # polling the condition the drain sets first
            release.set()
            assert codec.decode(call.result(BOUND_S)).meta["shard"] == 0  # answered, not cancelled
            assert seen == ["NOT_SERVING"]
            drainer.join(BOUND_S)
            assert not drainer.is_alive()  # it ended once the call in flight finished
        finally:
            release.set()
            node_.stop(1.0)


def test_a_worker_whose_address_is_taken_trains_on_without_a_health_service():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        config = NodeConfig(ClusterSpec(ps=("127.0.0.1:1",), worker=("127.0.0.1:2", address)), Task("worker", 1),
                            Options(metrics_port=0))
        with WorkerOps(config, NodeMetrics()) as ops:
            ops.wait_ready(10)
            ops.set_serving()
            scraped = scrape(f"127.0.0.1:{ops.endpoint.port}")
            assert scraped[("process_open_fds", ())] > 0
            assert ("paramserver_checkpoint_failures_total", ()) not in scraped  # a worker writes no checkpoint
