"""The long-lived things of paramserver as test cases (one `Case` each, built by `make_case` from its
name), and the checks every one must pass. tests/unit/test_lifecycle_shape.py runs them on the things that
start no process, tests/integration/test_lifecycle_processes.py on those that do (SPAWNING); each file
defines the `case` fixture from `make_case`.

The verdicts wait on the threads' `join` and on the processes' exit, each with a generous bound;
no sleep decides anything."""

from __future__ import annotations

import io
import itertools
import threading
import urllib.request
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psutil

from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task
from paramserver.base.lifecycle import Lifecycle
from paramserver.base.metrics import MetricsEndpoint, NodeMetrics
from paramserver.coordinator.coordinator_service import SERVICE as COORDINATOR
from paramserver.coordinator.coordinator_service import CoordinatorClient, CoordinatorService
from paramserver.coordinator.membership import Coordinator
from paramserver.data.loader import BatchLoader
from paramserver.launch.local.supervisor import LocalCluster
from paramserver.node.ps_node import PSNode
from paramserver.server.shard import Shard
from paramserver.server.shard_service import ShardService
from paramserver.transport.grpc_transport import GrpcChannel, GrpcServer
from paramserver.transport.grpc_transport import health_server as make_health_server
from paramserver.transport.health import Health, check
from paramserver.transport.stream_client import StreamClient
from paramserver.transport.stream_server import StreamServer
from paramserver.wire import codec
from paramserver.worker.cluster import CoordinatorHost
from paramserver.worker.ops import WorkerOps

BOUND_S = 30.0  # how long a thread or process may take to end after stop() returned; never reached


@dataclass
class Case:
    """One long-lived thing: `make()` builds it; `use(thing)` works it while it runs (returning what
    must be closed after its stop: test-side clients); `children` says whether it starts processes."""

    make: Callable[[], Lifecycle]
    use: Callable[[Any], list] = lambda thing: []
    children: bool = False


@contextmanager
def nothing_left_behind(expect_children: bool):
    """Threads and child processes started inside the block must all be gone at its end."""
    me = psutil.Process()
    threads_before = set(threading.enumerate())
    children_before = {p.pid for p in me.children(recursive=True)}
    seen: list[psutil.Process] = []

    def running_children() -> None:  # call while the thing runs: its processes, grandchildren included
        seen.extend(p for p in me.children(recursive=True) if p.pid not in children_before)

    yield running_children
    assert bool(seen) == expect_children, [p.pid for p in seen]
    _, alive = psutil.wait_procs(seen, timeout=BOUND_S)
    assert [p for p in alive if _running(p)] == []
    started = [t for t in threading.enumerate() if t not in threads_before]
    for thread in started:
        thread.join(BOUND_S)
    assert [t.name for t in started if t.is_alive()] == []


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def shard_service() -> ShardService:
    return ShardService(Shard(0))


def hello_over_grpc(address: str, service_name: str = "paramserver.Shard") -> list:
    channel = GrpcChannel(address, 1 << 20, use_stream=False, service_name=service_name)
    channel.wait_ready(20)
    channel.call("Hello", codec.encode({}), 20).wait(20)
    return [channel]


def grpc_server() -> Case:
    return Case(lambda: GrpcServer(shard_service(), "127.0.0.1:0", 1 << 20, threads=2),
                lambda server: hello_over_grpc(f"127.0.0.1:{server.port}"))


def stream_server() -> Case:
    def use(server: StreamServer) -> list:
        client = StreamClient("127.0.0.1", server.port, 1 << 20, "test", shared_memory=False)
        client.call("Hello", codec.encode({}), 20).wait(20)
        return [client]  # still connected when the server stops: stop() must cut it

    return Case(lambda: StreamServer(shard_service(), "127.0.0.1", 0, 1 << 20), use)


def ps_node() -> Case:
    def use(node: PSNode) -> list:
        channel = GrpcChannel(node.address, 1 << 20, use_stream=True, use_shared_memory=False)
        channel.wait_ready(20)
        channel.call("Hello", codec.encode({}), 20).wait(20)  # over the tensor stream
        scrape(node.endpoint.port)
        return [channel]

    return Case(lambda: PSNode("127.0.0.1:0", 0, Options(metrics_port=0)), use)


def scrape(port: int) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as reply:
        assert b"process_resident_memory_bytes" in reply.read()


def health_server() -> Case:
    def use(server) -> list:
        assert check(f"127.0.0.1:{server.port}", 20) == "NOT_SERVING"
        return []

    return Case(lambda: make_health_server(Health(), "127.0.0.1:0"), use)


def metrics_endpoint() -> Case:
    def use(endpoint: MetricsEndpoint) -> list:
        scrape(endpoint.port)
        return []

    return Case(lambda: MetricsEndpoint(NodeMetrics().registry, 0, "127.0.0.1"), use)


def worker_ops() -> Case:
    """A plain worker's: its own health server (on its cluster address) and its metrics endpoint."""
    def use(ops: WorkerOps) -> list:
        ops.set_serving()
        assert check(f"127.0.0.1:{ops.health_server.port}", 20) == "SERVING"
        scrape(ops.endpoint.port)
        return []

    config = NodeConfig(ClusterSpec(ps=("127.0.0.1:1",), worker=("127.0.0.1:0", "127.0.0.1:0")), Task("worker", 1),
                        Options(metrics_port=0))
    return Case(lambda: WorkerOps(config, NodeMetrics()), use)


def coordinator_host() -> Case:
    return Case(lambda: CoordinatorHost(1, "127.0.0.1:0", Options(heartbeat_s=0.05, heartbeat_timeout_s=5)),
                lambda host: hello_over_grpc(f"127.0.0.1:{host.server.port}", COORDINATOR))


def batch_loader() -> Case:
    def use(loader: BatchLoader) -> list:
        assert loader.ready.is_set()  # a first batch is waiting
        return []

    # an endless generator: its process is alive, blocked on a full pipe, when stop() comes
    return Case(lambda: BatchLoader(itertools.count, 0, depth=2, timeout_s=60), use, children=True)


def local_cluster(tmp_path) -> Case:
    script = tmp_path / "block.py"
    script.write_text("import threading\nthreading.Event().wait()\n")  # a worker that never ends by itself
    return Case(lambda: LocalCluster(1, 2, str(script), out=io.StringIO(), progress_every=0.1,
                                     log_level="WARNING"), children=True)


@contextmanager
def running_coordinator():
    """The coordinator a CoordinatorClient talks to (not under test: started before the count), as its
    address. One request thread: its pool starts it at the warm-up and never another, which a count during
    a CoordinatorClient test would take for the client's (a busy machine overlaps its calls)."""
    server = GrpcServer(CoordinatorService(Coordinator(1, 5.0)), "127.0.0.1:0", 1 << 20, 1, COORDINATOR)
    server.start()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        server.stop(1.0)


def coordinator_client(address: str) -> Case:
    def use(client: CoordinatorClient) -> list:
        assert client.view["live"] == [0]  # joined
        return []

    return Case(lambda: CoordinatorClient(GrpcChannel(address, 1 << 20, use_stream=False, service_name=COORDINATOR),
                                          0, 10.0, heartbeat_s=0.02), use)


def make_case(name: str, tmp_path, coordinator_server: str) -> Case:
    """The Case called `name` (one of ALL)."""
    return {"GrpcServer": grpc_server, "StreamServer": stream_server, "PSNode": ps_node,
            "CoordinatorHost": coordinator_host, "BatchLoader": batch_loader,
            "CoordinatorClient": lambda: coordinator_client(coordinator_server),
            "LocalCluster": lambda: local_cluster(tmp_path), "HealthServer": health_server,
            "MetricsEndpoint": metrics_endpoint, "WorkerOps": worker_ops}[name]()


ALL = ["GrpcServer", "StreamServer", "PSNode", "CoordinatorHost", "CoordinatorClient", "BatchLoader", "LocalCluster",
       "HealthServer", "MetricsEndpoint", "WorkerOps"]


SPAWNING = {"BatchLoader", "LocalCluster"}  # these start processes once started: the cluster tier


def warm_up_grpc(coordinator_server: str) -> None:
    """gRPC starts a few process-wide threads on first use; let them exist before any count."""
    for closable in hello_over_grpc(coordinator_server, COORDINATOR):
        closable.close()


def start_wait_ready_stop(case: Case) -> None:
    """start, wait_ready (twice), stop (twice): nothing it started is left."""
    with nothing_left_behind(case.children) as running_children:
        thing = case.make()
        thing.start()
        thing.wait_ready(60)
        thing.wait_ready(1)  # any number of times
        running_children()
        opened = case.use(thing)
        thing.stop(2.0)
        thing.stop(2.0)  # idempotent
        for closable in opened:
            closable.close()


def with_block(case: Case) -> None:
    """A `with` block: nothing it started is left after it."""
    with nothing_left_behind(case.children) as running_children:
        with case.make() as thing:
            thing.wait_ready(60)
            running_children()
            opened = case.use(thing)
        for closable in opened:
            closable.close()
