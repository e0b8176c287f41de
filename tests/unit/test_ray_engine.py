"""The Ray engine's checks that need no cluster (launch/ray): resource requests, the loopback rule, the message
without the `ray` extra, and what `run --engine ray` refuses. The engine on a real cluster: tests/engines."""

from __future__ import annotations

import sys

import pytest
from tests.conftest import ROOT

import paramserver
from paramserver.base.errors import ConfigError
from paramserver.launch.cli import commands
from paramserver.launch.cli.parser import parse_args
from paramserver.launch.ray import connect, placement

DIGITS = str(ROOT / "examples" / "digits.py")


def test_every_node_asks_for_one_cpu_unless_told():
    assert placement.requests(None) == {"ps": {"CPU": 1.0}, "worker": {"CPU": 1.0}}
    assert placement.requests({"CPU": 2, "GPU": 0}) == {"ps": {"CPU": 2.0}, "worker": {"CPU": 2.0}}
    by_role = placement.requests({"ps": {"memory": 2**30}, "worker": {"CPU": 4, "GPU": 1, "spare": 0.5}})
    assert by_role == {"ps": {"memory": 2.0**30}, "worker": {"CPU": 4.0, "GPU": 1.0, "spare": 0.5}}
    assert placement.actor_options(by_role["worker"]) == {"num_cpus": 4.0, "num_gpus": 1.0, "resources": {"spare": 0.5}}
    assert placement.actor_options(by_role["ps"]) == {"num_cpus": 0.0, "num_gpus": 0.0, "memory": 2.0**30}


@pytest.mark.parametrize(
    "resources, says",
    [
        ({"CPU": -1}, "'CPU'"),
        ({"CPU": "2"}, "'CPU'"),
        ({"GPU": True}, "'GPU'"),
        ({"chief": {"CPU": 1}}, "'chief'"),
        ([("CPU", 1)], "mapping"),
    ],
)
def test_a_bad_resource_request_is_refused_by_name(resources, says):
    with pytest.raises(ConfigError, match=says):
        placement.requests(resources)


def test_only_a_cluster_on_loopback_is_one(monkeypatch):
    monkeypatch.delenv(connect.ADDRESS_ENV, raising=False)
    assert connect.is_loopback("127.0.0.1:6379") and connect.is_loopback("localhost:1")
    assert not connect.is_loopback("10.0.0.1:6379") and not connect.is_loopback(None)
    monkeypatch.setenv(connect.ADDRESS_ENV, "127.0.0.1:6379")
    assert connect.is_loopback(None)


def test_without_ray_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'paramserver\[ray\]'"):
        paramserver.ray.run(DIGITS, num_ps=1, num_workers=1, address="10.0.0.1:6379")


def test_a_missing_script_or_a_bad_elastic_run_is_refused_before_ray_is_reached():
    with pytest.raises(ConfigError, match="no_such.py does not exist"):
        paramserver.ray.run(str(ROOT / "no_such.py"))
    with pytest.raises(ConfigError, match="max_workers"):  # elastic runs are supported; 4 workers > 3 slots is not
        paramserver.ray.run(DIGITS, num_workers=4, options=paramserver.Options(max_workers=3))


def test_run_engine_ray_refuses_the_local_launchers_flags():
    args = parse_args(["run", "--engine", "ray", "--address", "10.0.0.1:6379", "--tokens", "t", DIGITS])
    assert args.engine == "ray" and args.address == "10.0.0.1:6379"
    with pytest.raises(ConfigError, match="--engine ray does not take --tokens"):
        commands.run_local(args, args.script, [])
    assert parse_args(["run", DIGITS]).engine == "local"
