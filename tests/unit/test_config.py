import json

import pytest

from paramserver.base.config import ClusterSpec, Options, config_from_environ, load_cluster_file, parse_tf_config
from paramserver.base.errors import ConfigError

SEED = {"ps": ["localhost:2222"], "worker": ["localhost:2223", "localhost:2224"]}


def test_the_seed_articles_cluster_without_a_chief():
    config = parse_tf_config(json.dumps({"cluster": SEED, "task": {"type": "worker", "index": 1}}))
    assert config.cluster.ps == ("localhost:2222",)
    assert config.cluster.num_workers == 2
    assert config.worker_index == 1
    assert config.address == "localhost:2224"


def test_a_chief_is_worker_zero_and_shifts_the_workers():
    cluster = {**SEED, "chief": ["localhost:2221"]}
    chief = parse_tf_config(json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
    worker = parse_tf_config(json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}}))
    assert (chief.worker_index, worker.worker_index, worker.cluster.num_workers) == (0, 1, 3)


@pytest.mark.parametrize("text, fragment", [
    ("{", "TF_CONFIG is not valid"),
    (json.dumps({"cluster": SEED}), "TF_CONFIG is not valid"),
    (json.dumps({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}), "at least one 'ps'"),
    (json.dumps({"cluster": {**SEED, "gpu": ["a:1"]}, "task": {"type": "worker"}}), "unknown roles"),
    (json.dumps({"cluster": {**SEED, "ps": ["nohostport"]}, "task": {"type": "worker"}}), "host:port"),
    (json.dumps({"cluster": SEED, "task": {"type": "worker", "index": 5}}), "outside the cluster"),
    (json.dumps({"cluster": SEED, "task": {"type": "janitor", "index": 0}}), "not one of"),
])
def test_bad_tf_config_is_a_clear_error(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_tf_config(text)


def test_cluster_file_and_role_flags(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(SEED))
    config = load_cluster_file(path, "ps", 0)
    assert config.address == "localhost:2222"
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster_file(tmp_path / "missing.json", "ps", 0)


def test_options_come_from_the_environment_once():
    env = {"TF_CONFIG": json.dumps({"cluster": SEED, "task": {"type": "worker", "index": 0}}),
           "PARAMSERVER_OPTIONS": json.dumps({"rpc_timeout_s": 5})}
    assert config_from_environ(env).options.rpc_timeout_s == 5
    assert config_from_environ({}) is None
    with pytest.raises(ConfigError, match="unknown options"):
        Options.from_dict({"rpc_timeout": 5})


def test_cluster_spec_round_trips():
    assert ClusterSpec.from_dict(SEED).to_dict() == SEED


@pytest.mark.parametrize("values, fragment", [
    ({"checkpoint_every": -1, "checkpoint_dir": "/tmp/x"}, "out of range"),
    ({"checkpoint_keep": 0}, "keep 0"),
    ({"checkpoint_every": 10}, "need a checkpoint_dir"),
    ({"resume": 1}, "need a checkpoint_dir"),
])
def test_bad_checkpoint_options_are_refused_at_start(values, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Options.from_dict(values)
