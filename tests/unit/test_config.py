import json
import signal
from dataclasses import fields, replace

import pytest
from tests.tfjob import tfjob_cluster, tfjob_tf_config

from paramserver.base.byte_size import parse_byte_size
from paramserver.base.config import (
    OPTIONS_ENV,
    ClusterSpec,
    NodeConfig,
    Options,
    Task,
    config_from_environ,
    load_cluster_file,
    options_from_environ,
    parse_tf_config,
)
from paramserver.base.errors import ConfigError
from paramserver.base.options.fields import Range, range_of
from paramserver.launch import cli

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


def test_a_tfjob_master_replica_is_the_chief():
    replicas = {"master": 1, "ps": 2, "worker": 2}
    master = parse_tf_config(tfjob_tf_config(replicas, "master", 0))
    worker = parse_tf_config(tfjob_tf_config(replicas, "worker", 1))
    assert master.task == Task("chief", 0) and master.worker_index == 0
    assert master.cluster.chief == ("job-master-0.ns.svc:2222",) and master.address == "job-master-0.ns.svc:2222"
    assert (worker.worker_index, worker.cluster.num_workers) == (2, 3)
    both = {"cluster": {"master": ["a:1"], "chief": ["b:1"], "ps": ["c:1"]}, "task": {"type": "ps", "index": 0}}
    with pytest.raises(ConfigError, match="both 'chief' and 'master'"):
        parse_tf_config(json.dumps(both))


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


DIR = {"checkpoint_dir": "/tmp/checkpoints"}

# (option, its bad value, other options given with it): the ranges and rules of the options
BAD = [
    ("rpc_timeout_s", 0, {}), ("rpc_timeout_s", -1.5, {}), ("rpc_timeout_s", "5", {}), ("rpc_timeout_s", True, {}),
    ("rpc_timeout_s", float("nan"), {}), ("rpc_timeout_s", float("inf"), {}),
    ("connect_timeout_s", 0, {}), ("connect_timeout_s", None, {}),
    ("max_message_bytes", 0, {}), ("max_message_bytes", 2**31, {}), ("max_message_bytes", 1.5, {}),
    ("max_payload_bytes", 1 << 20, {"max_message_bytes": 1 << 21}), ("max_payload_bytes", "1", {}),
    ("split_bytes", 0, {}), ("split_bytes", "big", {}),
    ("ps_threads", 0, {}), ("ps_threads", 2.0, {}),
    ("stream_port", -1, {}), ("stream_port", 65536, {}),
    ("use_stream", 2, {}), ("use_stream", "true", {}), ("use_stream", 1.0, {}), ("use_stream", None, {}),
    ("shared_memory", -1, {}), ("shared_memory", "0", {}),
    ("torch_threads", -1, {}),
    ("progress_fd", -2, {}),
    ("mode", "bogus", {}), ("mode", "ssp", {}), ("mode", "ssp:x", {}), ("mode", "sync:2", {}), ("mode", 3, {}),
    ("backup_workers", -1, {}), ("backup_workers", 1, {}), ("backup_workers", 1, {"mode": "ssp:2"}),
    ("backup_workers", True, {"mode": "sync"}), ("backup_workers", 1, {"mode": "sync", "dense_sync": "allreduce"}),
    ("mode_schedule", "sync", {}), ("mode_schedule", "sync@x", {}), ("mode_schedule", "bogus@5", {}),
    ("mode_schedule", "sync@9,async@3", {}), ("mode_schedule", ["sync@5"], {}),
    ("max_table_ids", 0, {}),
    ("heartbeat_s", 0, {}), ("heartbeat_s", -1, {}),
    ("heartbeat_timeout_s", 2.0, {"heartbeat_s": 1.0}), ("heartbeat_timeout_s", 0, {}),
    ("checkpoint_dir", 5, {}),
    ("checkpoint_every", -1, DIR), ("checkpoint_every", 10, {}), ("checkpoint_every", 1.5, DIR),
    ("checkpoint_every_seconds", -1, DIR), ("checkpoint_every_seconds", 5, {}),
    ("checkpoint_every_seconds", 5, {**DIR, "dense_sync": "allreduce"}),
    ("checkpoint_keep", 0, DIR), ("checkpoint_keep", 0, {}), ("checkpoint_base_every", 0, {}),
    ("checkpoint_quantize", "fp8", {}),
    ("resume", True, {}), ("resume", 1, {}), ("resume", 2, DIR), ("resume", "yes", DIR),
    ("restore_non_finite", "yes", {}),
    ("eval_timeout_s", -1, {}), ("eval_timeout_s", float("inf"), {}), ("eval_timeout_s", "5", {}),
    ("max_table_rows", -1, {}), ("max_table_memory_bytes", -1, {}), ("max_table_memory_bytes", 1.5, {}),
    ("max_tiered_table_rows", 0, {}), ("max_tiered_table_rows", "1", {}),
    ("max_gradient_magnitude", 0, {}), ("max_gradient_magnitude", float("inf"), {}),
    ("table_memory_budget", -1, {}), ("table_memory_budget", 1000, {"spill_dir": "/s"}),
    ("table_memory_budget", 1 << 20, {}), ("table_memory_budget", "4GiB", {"spill_dir": "/s"}),
    ("table_memory_budget", 32 << 30, {"spill_dir": "/s", "max_table_memory_bytes": 16 << 30}),
    ("spill_dir", "/s", {}), ("spill_dir", 3, {"table_memory_budget": 1 << 20}),
    ("spill_full_grace_s", 0, {}), ("spill_full_grace_s", -1, {}), ("spill_full_grace_s", "x", {}),
    ("idle_timeout_s", 0, {}), ("max_connections", 0, {}),
    ("metrics_port", -2, {}), ("metrics_port", 65536, {}),
    ("metrics_bind", "", {}), ("metrics_bind", "host:9100", {}), ("metrics_bind", "a b", {}),
    ("log_format", "xml", {}), ("logdir", 3, {}), ("summary_every", 0, {}),
    ("audit_log", 1, {}), ("stop_ps_at_end", "yes", {}), ("drain_grace_s", -1, {}), ("preempt_grace_s", 0, {}),
    ("tls_cert", "/c.pem", {}), ("tls_key", "/k.pem", {}), ("tls_ca", "/ca.pem", {}),
    ("auth_tokens", 7, {}), ("token_file", None, {}), ("run_secret_file", 5, {}),
    ("compression", "zip", {}), ("compression", "topk:2", {}), ("compression", "=fp16", {}), ("compression", 1, {}),
    ("dense_sync", "ring", {}), ("dense_sync", None, {}),
    ("recovery", "half", DIR), ("recovery", 1, DIR), ("recovery", "partial", {}),
]


WRONG_TYPE = {"bool": "yes", "str": 5, "int": "7", "float": "x"}  # a value of another type, for each type


def test_the_bad_values_name_options_and_every_option_refuses_another_type():
    assert {name for name, _, _ in BAD} <= {f.name for f in fields(Options)}
    for f in fields(Options):  # a new option is checked for its type with no entry here
        with pytest.raises(ConfigError, match=f"^option {f.name!r} must be .*, got {WRONG_TYPE[f.type]!r}$"):
            Options.from_dict({f.name: WRONG_TYPE[f.type]})


@pytest.mark.parametrize("name, value, others", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_every_bad_option_is_one_config_error_naming_it(name, value, others):
    with pytest.raises(ConfigError) as caught:
        Options.from_dict({**others, name: value})
    message = str(caught.value)
    assert f"option {name!r}" in message
    assert [f.name for f in fields(Options) if f"option {f.name!r}" in message] == [name]  # that one only
    assert caught.value.__cause__ is None  # one error, not a chain of them


def test_several_bad_options_are_one_error_naming_each():
    with pytest.raises(ConfigError) as caught:
        Options.from_dict({"ps_threads": 0, "use_stream": 5, "mode": "bogus", "checkpoint_every": 3})
    for name in ("ps_threads", "use_stream", "mode", "checkpoint_every"):
        assert f"option {name!r}" in str(caught.value)


def test_a_declared_range_is_checked_with_its_words():
    assert range_of(next(f for f in fields(Options) if f.name == "stream_port")) == Range(
        0, 65535, says="a port number from 0 to 65535"
    )
    with pytest.raises(ConfigError, match="^option 'spill_full_grace_s' must be positive, got 0.0$"):
        Options(spill_full_grace_s=0)
    with pytest.raises(ConfigError, match="^option 'max_message_bytes' must be between 1024 and 2147483647, got 1023$"):
        Options(max_message_bytes=1023)
    with pytest.raises(ConfigError, match=r"^option 'metrics_port' must be -1 \(none\), 0 \(a free port\) or a"):
        Options(metrics_port=-2)
    edges = Options(metrics_port=-1, stream_port=65535, max_message_bytes=1024, spill_full_grace_s=0.5)
    assert (edges.metrics_port, edges.stream_port, edges.spill_full_grace_s) == (-1, 65535, 0.5)


def test_python_callers_get_the_same_checks():
    with pytest.raises(ConfigError, match="option 'ps_threads' must be at least 1"):
        Options(ps_threads=0)
    with pytest.raises(ConfigError, match="option 'use_stream' must be true or false, got 1"):
        Options(use_stream=1)  # 0 / 1 only in from_dict (JSON written before options were booleans)
    with pytest.raises(ConfigError, match="option 'resume' needs a checkpoint_dir"):
        replace(Options(), resume=True)
    assert isinstance(Options(rpc_timeout_s=5).rpc_timeout_s, float)


def test_the_number_of_workers_is_checked_where_it_is_known():
    options = Options(mode="sync", backup_workers=2)  # fine for a cluster of 3 or more
    assert options.consistency(3).quorum == 1
    with pytest.raises(ConfigError, match="option 'backup_workers' is not valid: 2 backup workers need"):
        options.validate(num_workers=2)
    cluster = ClusterSpec.from_dict(SEED)  # 2 workers
    with pytest.raises(ConfigError, match="option 'backup_workers'"):
        NodeConfig(cluster, Task("worker", 0), options)
    with pytest.raises(ConfigError, match="^option 'backup_workers' is not valid"):
        parse_tf_config(json.dumps({"cluster": SEED, "task": {"type": "worker", "index": 0}}), options)


def test_booleans_round_trip_through_json_and_the_environment():
    options = Options(use_stream=False, shared_memory=False, resume=True, checkpoint_dir="/tmp/c")
    data = json.loads(options.to_json())
    assert (data["use_stream"], data["shared_memory"], data["resume"]) == (False, False, True)
    assert '"use_stream": false' in options.to_json()
    assert Options.from_dict(data) == options
    assert options_from_environ({OPTIONS_ENV: options.to_json()}) == options
    assert Options.from_dict(json.loads(Options().to_json())) == Options()


def test_zero_and_one_still_read_as_booleans_from_files_and_the_environment(tmp_path):
    """Cluster files and PARAMSERVER_OPTIONS written when these options were ints keep working."""
    legacy = {"use_stream": 0, "shared_memory": 1, "resume": 1, "checkpoint_dir": "/tmp/c"}
    from_env = options_from_environ({OPTIONS_ENV: json.dumps(legacy)})
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"cluster": SEED, "options": legacy}))
    from_file = load_cluster_file(path, "worker", 0).options
    for options in (from_env, from_file, Options.from_dict(legacy)):
        assert (options.use_stream, options.shared_memory, options.resume) == (False, True, True)
        assert all(type(getattr(options, name)) is bool for name in ("use_stream", "shared_memory", "resume"))
    with pytest.raises(ConfigError, match="^option 'shared_memory' must be true or false, got 2$"):
        options_from_environ({OPTIONS_ENV: json.dumps({"shared_memory": 2})})
    with pytest.raises(ConfigError, match="PARAMSERVER_OPTIONS is not valid JSON"):
        options_from_environ({OPTIONS_ENV: "{use_stream: 1}"})


def test_the_command_line_gives_booleans_and_refuses_bad_options_before_starting(capsys):
    args = cli.build_parser().parse_args(["run", "--resume", "--checkpoint-dir", "/tmp/c", "train.py"])
    assert cli.given_options(args)["resume"] is True
    assert "resume" not in cli.given_options(cli.build_parser().parse_args(["run", "train.py"]))
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main(["run", "--workers", "2", "--mode", "sync", "--backup-workers", "2", "no_such_script.py"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 2
    assert "option 'backup_workers' is not valid" in capsys.readouterr().err


TFJOB = {"Chief": 1, "PS": 2, "Worker": 3, "Evaluator": 1}


def test_a_tfjob_evaluator_is_no_worker():
    evaluator = parse_tf_config(tfjob_tf_config(TFJOB, "Evaluator", 0))
    worker = parse_tf_config(tfjob_tf_config(TFJOB, "Worker", 2))
    assert evaluator.task == Task("evaluator", 0)
    assert evaluator.cluster.evaluator == ("job-evaluator-0.ns.svc:2222",)
    assert evaluator.address == "job-evaluator-0.ns.svc:2222"
    assert evaluator.cluster.num_workers == worker.cluster.num_workers == 4  # the chief and 3 workers
    assert worker.worker_index == 3
    assert "job-evaluator-0.ns.svc:2222" not in worker.cluster.worker + worker.cluster.chief


@pytest.mark.parametrize("task_type, index", [("PS", 0), ("PS", 1), ("Worker", 0), ("Worker", 2), ("Chief", 0),
                                              ("Evaluator", 0)])
def test_the_sparse_form_with_the_whole_cluster_agrees_with_the_dense_form(task_type, index):
    whole = ClusterSpec.from_dict(tfjob_cluster(TFJOB))
    dense = parse_tf_config(tfjob_tf_config(TFJOB, task_type, index))
    sparse = parse_tf_config(tfjob_tf_config(TFJOB, task_type, index, sparse=True), cluster=whole)
    assert sparse == dense
    from_environ = config_from_environ({"TF_CONFIG": tfjob_tf_config(TFJOB, task_type, index, sparse=True),
                                        "PARAMSERVER_CLUSTER": json.dumps(tfjob_cluster(TFJOB))})
    assert from_environ == dense


def test_a_sparse_master_is_the_chief_of_the_whole_cluster():
    replicas = {"Master": 1, "PS": 1, "Worker": 1}
    whole = ClusterSpec.from_dict(tfjob_cluster(replicas))
    master = parse_tf_config(tfjob_tf_config(replicas, "Master", 0, sparse=True), cluster=whole)
    assert master.task == Task("chief", 0) and master.address == "job-master-0.ns.svc:2222"


@pytest.mark.parametrize("task_type", ["PS", "Worker", "Chief", "Evaluator"])
def test_the_sparse_form_alone_names_where_the_whole_cluster_comes_from(task_type):
    with pytest.raises(ConfigError, match="PARAMSERVER_CLUSTER"):
        parse_tf_config(tfjob_tf_config(TFJOB, task_type, 0, sparse=True))
    with pytest.raises(ConfigError, match="PARAMSERVER_CLUSTER"):
        config_from_environ({"TF_CONFIG": tfjob_tf_config(TFJOB, task_type, 0, sparse=True)})


@pytest.mark.parametrize("task_type, index, named", [
    ("Worker", 1, "worker:1"),  # the worker's own address differs
    ("PS", 1, "ps:1"),  # the PS's own address differs
])
def test_a_sparse_form_contradicting_the_whole_cluster_is_refused_naming_the_task(task_type, index, named):
    other_job = ClusterSpec.from_dict(tfjob_cluster(TFJOB, job="other"))
    with pytest.raises(ConfigError, match=named):
        parse_tf_config(tfjob_tf_config(TFJOB, task_type, index, sparse=True), cluster=other_job)


def test_a_worker_outside_the_whole_cluster_is_refused():
    smaller = ClusterSpec.from_dict(tfjob_cluster({"Chief": 1, "PS": 2, "Worker": 1}))
    with pytest.raises(ConfigError, match="worker:2"):
        parse_tf_config(tfjob_tf_config(TFJOB, "Worker", 2, sparse=True), cluster=smaller)
    fewer_ps = ClusterSpec.from_dict(tfjob_cluster({"Chief": 1, "PS": 1, "Worker": 3}))
    with pytest.raises(ConfigError, match="ps:1"):  # a worker's sparse form lists every PS
        parse_tf_config(tfjob_tf_config(TFJOB, "Worker", 0, sparse=True), cluster=fewer_ps)


@pytest.mark.parametrize("sparse", [{"worker": {"one": "a:1"}, "ps": []}, {"worker": [], "ps": "a:1"},
                                    {"worker": {"0": 7}, "ps": []}, ["a:1"]])
def test_a_malformed_sparse_form_is_a_config_error(sparse):
    whole = ClusterSpec.from_dict(tfjob_cluster(TFJOB))
    with pytest.raises(ConfigError, match="TF_CONFIG"):
        parse_tf_config(json.dumps({"sparseCluster": sparse, "task": {"type": "worker", "index": 0}}),
                        cluster=whole)


@pytest.mark.parametrize("text, size", [
    ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("512mib", 512 << 20), ("16Gi", 16 << 30), ("1.5GiB", 3 << 29),
    ("1000000", 10**6), ("2GB", 2 * 10**9), ("64 KiB", 64 << 10), ("0", 0), ("7B", 7),
])
def test_sizes_in_bytes_read_as_people_write_them(text, size):
    assert parse_byte_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "4XB", "-1", "4 G i B", "1e9"])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(ValueError, match="not a size in bytes"):
        parse_byte_size(text)


def test_the_tiered_table_flags_set_their_options(capsys):
    args = cli.parse_args(["node", "--role", "ps", "--table-memory-budget", "4GiB", "--spill-dir", "/ssd",
                           "--max-tiered-table-rows", "1000", "--max-table-memory", "16GiB"])
    given = cli.given_options(args)
    assert (given["table_memory_budget"], given["spill_dir"]) == (4 << 30, "/ssd")
    assert (given["max_tiered_table_rows"], given["max_table_memory_bytes"]) == (1000, 16 << 30)
    Options(**given)  # valid together
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["node", "--table-memory-budget", "lots"])
    assert "not a size in bytes" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="'table_memory_budget' needs a spill_dir"):
        Options(table_memory_budget=1 << 30)
