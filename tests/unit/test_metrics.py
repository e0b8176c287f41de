"""A node's metrics: the per-call hook of dispatch.answer, the shard collector read at scrape time,
checkpoint timings, Prometheus naming; and the health status holder."""

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from paramserver.base.metrics import NodeMetrics
from paramserver.server.shard import Shard
from paramserver.server.shard_metrics import ShardCollector
from paramserver.server.shard_service import ShardService
from paramserver.transport.dispatch import answer
from paramserver.transport.grpc_transport import SERVICE
from paramserver.transport.health import Health
from paramserver.wire import codec

SGD = {"name": "sgd", "hyper": {"lr": 0.1}}
ROWS = {"name": "adagrad", "hyper": {"lr": 0.1}}


def samples(metrics: NodeMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def node():
    metrics = NodeMetrics()
    service = ShardService(Shard(0))
    service.calls = metrics.calls(SERVICE, service.methods)
    metrics.registry.register(ShardCollector(service.shard, service.tables))
    return metrics, service


def call(service, method: str, meta: dict, tensors=()):
    return answer(service, method, codec.encode(meta, list(tensors)), "test")


def calls(metrics, method, code):
    return samples(metrics).get(
        ("paramserver_calls_total", (("code", code), ("method", method), ("service", SERVICE))), 0
    )


def test_every_answer_is_counted_by_method_and_code_with_its_bytes_and_latency(node):
    metrics, service = node
    register = codec.encode({"group": "g", "optimizer": SGD}, [("w", np.ones(4, np.float32))])
    assert answer(service, "Register", register, "test").ok
    for _ in range(3):
        assert call(service, "PushPull", {"worker": 0}, [("w", np.ones(4, np.float32))]).ok
    refused = call(service, "PushPull", {"worker": 0}, [("w", np.ones(5, np.float32))])
    assert not refused.ok
    assert not call(service, "NoSuchMethod", {}).ok
    assert calls(metrics, "PushPull", "OK") == 3
    assert calls(metrics, "PushPull", refused.code.name) == 1
    assert calls(metrics, "unknown", "NOT_FOUND") == 1  # a method the service lacks: one label for all
    found = samples(metrics)
    labels = (("method", "PushPull"), ("service", SERVICE))
    assert found[("paramserver_call_duration_seconds_count", labels)] == 4
    assert found[("paramserver_call_duration_seconds_sum", labels)] > 0
    assert found[("paramserver_request_bytes_total", (("method", "Register"), ("service", SERVICE)))] == len(register)
    assert found[("paramserver_reply_bytes_total", labels)] >= 3 * 16  # three replies carrying 4 floats each
    assert found[("paramserver_pushes_total", (("shard", "0"),))] == 3  # the refused push is not counted
    assert found[("paramserver_updates_applied_total", (("shard", "0"),))] == 3


def test_tables_are_read_when_scraped(node):
    metrics, service = node
    assert call(service, "RegisterTable", {"table": "emb", "dim": 4, "optimizer": ROWS, "init": {"kind": "zeros"}}).ok
    assert call(service, "Lookup", {"table": "emb"}, [("ids", np.arange(5, dtype=np.int64))]).ok
    found = samples(metrics)
    labels = (("shard", "0"), ("table", "emb"))
    assert found[("paramserver_table_rows", labels)] == 5
    assert found[("paramserver_table_admissions_total", labels)] == 5
    assert found[("paramserver_table_bytes", labels)] == service.tables.describe()["emb"]["bytes"]
    assert found[("paramserver_table_evictions_total", labels)] == 0


def test_names_follow_prometheus_conventions(node):
    metrics, service = node
    call(service, "RegisterTable", {"table": "emb", "dim": 4, "optimizer": ROWS, "init": {"kind": "zeros"}})
    families = list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))
    ours = [f for f in families if f.name.startswith("paramserver_")]
    assert len(ours) >= 20
    for family in ours:
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        assert not family.name.endswith(("_ms", "_kb", "_mb", "_milliseconds")), family.name


def test_checkpoint_writes_are_timed_and_failures_counted():
    metrics = NodeMetrics()

    with metrics.checkpoint_metrics().timed():
        pass
    with pytest.raises(OSError), metrics.checkpoint_metrics().timed():
        raise OSError("disk full")
    found = samples(metrics)
    assert found[("paramserver_checkpoint_duration_seconds_count", ())] == 1
    assert found[("paramserver_checkpoint_failures_total", ())] == 1


def test_a_node_that_writes_no_checkpoint_exports_no_checkpoint_metrics():
    assert not any(name.startswith("paramserver_checkpoint") for name, _ in samples(NodeMetrics()))


def test_two_nodes_in_one_process_keep_their_own_metrics():
    first, second = NodeMetrics(), NodeMetrics()
    first.calls(SERVICE, ["Hello"]).observe("Hello", "OK", 0.001, 1, 2)
    assert samples(first)[("paramserver_calls_total", (("code", "OK"), ("method", "Hello"), ("service", SERVICE)))] == 1
    assert not any(name == "paramserver_calls_total" for name, _ in samples(second))


def test_health_goes_serving_then_draining_for_good():
    health = Health(("paramserver.Shard",))
    assert [health.status(s) for s in ("", "paramserver.Shard")] == ["NOT_SERVING", "NOT_SERVING"]
    health.set_serving()
    assert [health.status(s) for s in ("", "paramserver.Shard")] == ["SERVING", "SERVING"]
    health.set_draining()
    health.set_serving()  # too late: a draining node never serves again
    assert [health.status(s) for s in ("", "paramserver.Shard")] == ["NOT_SERVING", "NOT_SERVING"]


def test_run_refuses_one_fixed_metrics_port_for_nodes_that_share_a_host(capsys):
    from paramserver.launch import cli

    assert cli.main(["run", "--metrics-port", "9100", "no_such_script.py"]) == 2
    assert "--metrics-port 0" in capsys.readouterr().err


def test_the_metrics_endpoint_listens_on_localhost_and_idle_connections_cost_a_bounded_pool(monkeypatch):
    """300 idle connections hold at most HELD of them and THREADS threads; once they time out (or are
    closed at once, past HELD), a scrape is answered."""
    import socket
    import threading
    import time
    import urllib.error
    import urllib.request

    from paramserver.base import metrics_http
    from paramserver.base.metrics import MetricsEndpoint

    # read at each accept: the held connections time out in about HELD / THREADS * 0.5 s, not 5 s each
    monkeypatch.setattr(metrics_http, "REQUEST_TIMEOUT_S", 0.5)
    endpoint = MetricsEndpoint(NodeMetrics().registry, 0, what="test")
    port = endpoint.start()
    idle = []
    try:
        assert endpoint.host == "127.0.0.1" and endpoint._server.server_address[0] == "127.0.0.1"
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(300)]
        time.sleep(0.5)  # the server took them (or closed them)
        assert threading.active_count() - before <= metrics_http.THREADS
        closed = 0
        for sock in idle:
            sock.settimeout(0.01)
            try:
                closed += sock.recv(1) == b""
            except TimeoutError:
                pass
        assert closed >= len(idle) - metrics_http.HELD  # the rest were closed at once, unanswered
        deadline = time.monotonic() + 4 * metrics_http.REQUEST_TIMEOUT_S
        while True:  # the held ones time out: then a scrape is answered
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
                    assert b"process_resident_memory_bytes" in reply.read()
                break
            except urllib.error.HTTPError:
                raise
            except OSError:
                assert time.monotonic() < deadline, "no scrape answered after the idle connections timed out"
                time.sleep(0.2)
        with pytest.raises(urllib.error.HTTPError) as elsewhere:  # only /metrics is served
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30)
        assert elsewhere.value.code == 404
    finally:
        for sock in idle:
            sock.close()
        endpoint.stop()
