"""An elastic run's configuration: max_workers slots, workers the cluster does not list, the modes it refuses."""

import json

import pytest

from paramserver.base.config import ClusterSpec, Options, parse_tf_config
from paramserver.base.consistency_spec import ConsistencySpec
from paramserver.base.errors import ConfigError, InvalidArgumentError

WHOLE = ClusterSpec.from_dict({"chief": ["job-chief-0.ns.svc:2222"], "ps": ["job-ps-0.ns.svc:2222"]})


def sparse(index: int) -> str:
    return json.dumps(
        {
            "sparseCluster": {
                "ps": ["job-ps-0.ns.svc:2222"],
                "worker": {str(index): f"job-worker-{index}.ns.svc:2222"},
            },
            "task": {"type": "worker", "index": index},
        }
    )


def test_a_worker_the_whole_cluster_does_not_list_joins_an_elastic_run_with_its_own_address():
    config = parse_tf_config(sparse(5), Options(max_workers=8), WHOLE)
    assert config.worker_index == 6 and config.num_workers == 8  # the chief is worker 0
    assert config.address == "job-worker-5.ns.svc:2222"


def test_tf_config_with_no_worker_list_joins_an_elastic_run():
    text = json.dumps({"cluster": {"chief": ["c:1"], "ps": ["p:1"]}, "task": {"type": "worker", "index": 2}})
    config = parse_tf_config(text, Options(max_workers=4))
    assert config.worker_index == 3 and config.address is None


@pytest.mark.parametrize(
    "options, fragment",
    [
        (Options(), "no such task"),  # not elastic: only the listed workers
        (Options(max_workers=4), "indices below 3"),  # slot 6 of 4
    ],
)
def test_a_worker_outside_the_slots_is_refused_naming_why(options, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_tf_config(sparse(5), options, WHOLE)


@pytest.mark.parametrize(
    "given, fragment",
    [
        ({"max_workers": 4, "backup_workers": 1, "mode": "sync"}, "backup_workers"),
        ({"max_workers": 4, "dense_sync": "allreduce"}, "dense_sync"),
        ({"max_workers": 1}, "at least the 2 workers"),
        ({"max_workers": -1}, "max_workers"),
    ],
)
def test_what_an_elastic_run_refuses_is_named(given, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Options.from_dict(given).validate(2)


def test_an_elastic_spec_keeps_its_slots_and_refuses_backups():
    spec = ConsistencySpec.parse("ssp:2", 6, elastic=True)
    assert spec.elastic and spec.workers == 6 and "elastic" in str(spec)
    assert ConsistencySpec.from_dict(spec.to_dict()) == spec
    assert "elastic" not in ConsistencySpec.parse("sync", 2).to_dict()  # the form earlier nodes read
    with pytest.raises(InvalidArgumentError, match="backup"):
        ConsistencySpec.parse("sync", 6, backups=1, elastic=True)
