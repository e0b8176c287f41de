"""Prometheus metrics of a node: a registry per node, the per-call metrics every server records, the
checkpoint timings, and the HTTP endpoint that serves them (docs/operations.md lists every metric).

Each node object owns a NodeMetrics with its own CollectorRegistry (not prometheus_client's global
one), so several nodes in one process (tests, the in-process cluster) never collide. What a node
already counts (a shard's pushes, a table's rows) is read at scrape time by a Collector of its layer;
what only passes by (a call's latency, a checkpoint's duration) is observed here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector

from paramserver.base.errors import UnavailableError
from paramserver.base.lifecycle import Lifecycle, ReadyFlag
from paramserver.base.metrics_http import serve_metrics

if TYPE_CHECKING:
    from paramserver.base.metrics_http import PooledWSGIServer

log = logging.getLogger(__name__)
# latency buckets in seconds: a pull on one host is ~1 ms, a sync step may wait for the slowest worker
_CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
UNKNOWN_METHOD = "unknown"  # the label of calls naming no method of the service: labels stay few


def rss_bytes() -> int:
    """This process's resident memory now, in bytes."""
    return psutil.Process().memory_info().rss


class CallMetrics:
    """Calls a server answered, by method and status code: count, latency, request and reply bytes.
    `transport.dispatch.answer` records every call of a service that has one as `.calls`."""

    def __init__(self, registry: CollectorRegistry, service: str, methods: Any) -> None:
        self.service = service
        self.methods = frozenset(methods)
        self.calls = Counter(
            "paramserver_calls",
            "Calls answered, by service, method and status code",
            ("service", "method", "code"),
            registry=registry,
        )
        self.latency = Histogram(
            "paramserver_call_duration_seconds",
            "Time to answer a call, by service and method",
            ("service", "method"),
            registry=registry,
            buckets=_CALL_BUCKETS,
        )
        self.received = Counter(
            "paramserver_request_bytes",
            "Bytes of requests received, by service and method",
            ("service", "method"),
            registry=registry,
        )
        self.sent = Counter(
            "paramserver_reply_bytes",
            "Bytes of replies sent (errors included), by service and method",
            ("service", "method"),
            registry=registry,
        )

        self._children: dict[tuple[str, str], tuple] = {}  # (method, code) -> its labelled metrics

    def observe(self, method: str, code: str, seconds: float, request_bytes: int, reply_bytes: int) -> None:
        method = method if method in self.methods else UNKNOWN_METHOD
        calls, latency, received, sent = self._labelled(method, code)
        calls.inc()
        latency.observe(seconds)
        received.inc(request_bytes)
        sent.inc(reply_bytes)

    def _labelled(self, method: str, code: str) -> tuple:
        """The four metrics of (method, code), labelled once: labels() takes a lock and builds a key
        each time, and this runs on every call a server answers."""
        found = self._children.get((method, code))
        if found is None:  # a race here labels twice and keeps either: labels() returns the same child
            found = self._children[(method, code)] = (
                self.calls.labels(self.service, method, code),
                self.latency.labels(self.service, method),
                self.received.labels(self.service, method),
                self.sent.labels(self.service, method),
            )
        return found


class CheckpointMetrics:
    """Checkpoint writes of a node (a PS's shard file, the chief's whole checkpoint): durations and failures."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "paramserver_checkpoint_duration_seconds",
            "Time to write a checkpoint (a PS: its shard file; the chief: the whole checkpoint, manifest included)",
            registry=registry,
            buckets=_CHECKPOINT_BUCKETS,
        )
        self.failures = Counter("paramserver_checkpoint_failures", "Checkpoint writes that failed", registry=registry)

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Time the block as one checkpoint write; an exception out of it counts a failure."""
        started = time.perf_counter()
        try:
            yield
        except BaseException:
            self.failures.inc()
            raise
        self.duration.observe(time.perf_counter() - started)


class NodeMetrics:
    """One node's registry, with the process collector (memory, CPU, open files) in it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.checkpoints: CheckpointMetrics | None = None  # see `checkpoint_metrics`

    def checkpoint_metrics(self) -> CheckpointMetrics:
        """The node's checkpoint metrics, registered on first use: only a node that writes checkpoints (a PS
        with a checkpoint_dir, the chief) exports them; elsewhere they would read 0 forever."""
        if self.checkpoints is None:
            self.checkpoints = CheckpointMetrics(self.registry)
        return self.checkpoints

    def calls(self, service: str, methods: Any) -> CallMetrics:
        return CallMetrics(self.registry, service, methods)


class MetricsEndpoint(Lifecycle):
    """Serves a registry at http://HOST:PORT/metrics (Prometheus text format), on a bounded pool of
    threads (metrics_http.py). HOST: Options.metrics_bind (127.0.0.1 unless set).

    Lifecycle (base/lifecycle.py): `start()` binds and returns the port (`port` 0: a free one, logged);
    `wait_ready(timeout)`; `stop(grace)` shuts the server down and joins its thread "metrics-http"
    (a scrape in progress gets `grace` seconds).
    """

    def __init__(self, registry: CollectorRegistry, port: int, host: str = "127.0.0.1", what: str = "node") -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self.what = what
        self.ready = ReadyFlag(f"metrics endpoint of {what}")
        self._server: PooledWSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    def start(self) -> int:
        try:
            self._server, self._thread = serve_metrics(self.registry, self.host, self.port)
        except OSError as exc:
            error = UnavailableError(f"metrics endpoint of {self.what}: cannot bind {self.host}:{self.port}: {exc}")
            self.ready.fail(error)
            raise error from exc
        self.port = self._server.server_port
        log.info("%s: Prometheus metrics on http://%s:%d/metrics", self.what, self.host, self.port)
        self.ready.set()
        return self.port

    def wait_ready(self, timeout: float) -> None:
        self.ready.wait(timeout)

    def stop(self, grace: float = 1.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.ready.fail(UnavailableError(f"metrics endpoint of {self.what} stopped"))
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:  # set together with the server
            self._thread.join(grace)
