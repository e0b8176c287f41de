"""`paramserver node` under srun: the cluster and this task's role from a Slurm job step's environment
(launch/slurm). The environments below are those of real steps on a two-node Slurm 22.05 cluster
(network namespaces: node1 = 10.77.0.11, node2 = 10.77.0.12); resolving a name goes through a table
for those nodes, through the machine's resolver where the test says so."""

import threading

import pytest

from paramserver.base.config import TF_CONFIG_ENV, Options, bind_address
from paramserver.base.errors import ConfigError
from paramserver.launch import node_command
from paramserver.launch.slurm.environment import (
    in_slurm_step,
    place,
    resolve_host,
    resolve_nodes,
    slurm_config,
)
from paramserver.launch.slurm.hostlist import MAX_HOSTS, expand_counts, expand_hosts

NODES = {"node1": "10.77.0.11", "node2": "10.77.0.12", "node3": "10.77.0.13"}

# `srun -N 2 -n 2` inside an sbatch script, the task on node2 (SLURM_ variables as printed by `env`)
TWO_NODE_STEP = {
    "SLURMD_NODENAME": "node2",
    "SLURM_CLUSTER_NAME": "pslab",
    "SLURM_CPUS_ON_NODE": "1",
    "SLURM_DISTRIBUTION": "cyclic",
    "SLURM_GTIDS": "1",
    "SLURM_JOBID": "3",
    "SLURM_JOB_CPUS_PER_NODE": "1(x2)",
    "SLURM_JOB_ID": "3",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_NODELIST": "node[1-2]",
    "SLURM_NODE_ALIASES": "(null)",
    "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "1",
    "SLURM_STEPID": "1",
    "SLURM_STEP_ID": "1",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_TOPOLOGY_ADDR": "node2",
}
# a hetjob (`-N1 -n1 --mem=1000` : `-N1 -n2 --gres=gpu:1`), step `srun --het-group=0,1`, the task of rank 1
HET_STEP = {
    "SLURMD_NODENAME": "node2",
    "SLURM_DISTRIBUTION": "block",
    "SLURM_GTIDS": "1,2",
    "SLURM_HET_SIZE": "2",
    "SLURM_JOBID": "5",
    "SLURM_JOB_ID": "5",
    "SLURM_JOB_ID_HET_GROUP_0": "5",
    "SLURM_JOB_ID_HET_GROUP_1": "6",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_JOB_NODELIST_HET_GROUP_0": "node1",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "node2",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_NPROCS": "3",
    "SLURM_NTASKS": "3",
    "SLURM_NTASKS_HET_GROUP_0": "1",
    "SLURM_NTASKS_HET_GROUP_1": "2",
    "SLURM_PACK_SIZE": "2",
    "SLURM_PROCID": "1",
    "SLURM_STEP_GPUS": "0",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_TASKS_PER_NODE": "1,2",
    "SLURM_TASKS_PER_NODE": "1,2",
    "SLURM_TASKS_PER_NODE_HET_GROUP_0": "1",
    "SLURM_TASKS_PER_NODE_HET_GROUP_1": "2",
}


def table(addresses=NODES):
    def resolve(name):
        if name not in addresses:
            raise OSError(f"[Errno -2] Name or service not known: {name}")
        return addresses[name]

    return resolve


def config_of(environ, resolve=None, **options):
    return slurm_config(environ, Options(**options), resolve or table())


def step(nodes, counts, rank, **more):
    """A plain step's environment for `rank`, with only what the layout needs."""
    return {"SLURM_STEP_NODELIST": nodes, "SLURM_STEP_TASKS_PER_NODE": counts, "SLURM_PROCID": str(rank)} | {
        "SLURM_JOB_ID": "41",
        **more,
    }


def test_a_two_node_step_makes_rank_0_the_ps_and_rank_1_the_chief():
    port = 20000 + 3 * 20  # derived from SLURM_JOB_ID=3
    config = config_of(TWO_NODE_STEP)
    assert config.cluster.to_dict() == {"ps": [f"10.77.0.11:{port}"], "chief": [f"10.77.0.12:{port}"]}
    assert (config.task.type, config.task.index) == ("chief", 0)
    ps = config_of(
        TWO_NODE_STEP | {"SLURMD_NODENAME": "node1", "SLURM_PROCID": "0", "SLURM_GTIDS": "0", "SLURM_NODEID": "0"}
    )
    assert ps.cluster == config.cluster
    assert (ps.task.type, ps.task.index) == ("ps", 0)
    assert ps.options.stream_port == port + 1  # the PS's tensor stream: the next port
    assert bind_address(ps.listed_address()) == f"0.0.0.0:{port}"
    assert config.options.stream_port == 0  # a worker serves no stream


def test_a_heterogeneous_step_takes_component_0_as_the_ps():
    port = 20000 + 5 * 20
    ranks = [
        (0, "node1", "0", "0"),
        (1, "node2", "1,2", "0"),
        (2, "node2", "1,2", "1"),
    ]
    tasks = []
    for rank, node, gtids, local in ranks:
        environ = HET_STEP | {
            "SLURM_PROCID": str(rank),
            "SLURMD_NODENAME": node,
            "SLURM_GTIDS": gtids,
            "SLURM_LOCALID": local,
        }
        config = config_of(environ, slurm_ps=2)  # slurm_ps does not count in a heterogeneous job
        assert config.cluster.to_dict() == {
            "ps": [f"10.77.0.11:{port}"],
            "chief": [f"10.77.0.12:{port}"],
            "worker": [f"10.77.0.12:{port + 2}"],  # the second task on node2: 2 ports further
        }
        tasks.append((config.task.type, config.task.index))
    assert tasks == [("ps", 0), ("chief", 0), ("worker", 0)]


def test_a_heterogeneous_step_must_span_every_component():
    one_component = HET_STEP | {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node2"}
    with pytest.raises(ConfigError, match="--het-group"):
        config_of(one_component)
    missing = {k: v for k, v in HET_STEP.items() if k != "SLURM_TASKS_PER_NODE_HET_GROUP_1"}
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE_HET_GROUP_1 is not set"):
        config_of(missing)
    with pytest.raises(ConfigError, match="component 1"):
        config_of(HET_STEP | {"SLURM_NTASKS_HET_GROUP_1": "3", "SLURM_STEP_NUM_TASKS": "4"})


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[1-3,7],gpu[01-02]", ["node1", "node2", "node3", "node7", "gpu01", "gpu02"]),
        ("a,b", ["a", "b"]),
        ("node1", ["node1"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[007]", ["n007"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("x.dom-1,y_2[3-4].cluster", ["x.dom-1", "y_23.cluster", "y_24.cluster"]),
    ],
)
def test_host_lists_expand_as_slurm_writes_them(text, hosts):
    assert expand_hosts(text, "SLURM_STEP_NODELIST") == hosts


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "host list"),
        ("node[1-2", "never closed"),
        ("node1]", "without"),
        ("node[1-[2]]", "nested"),
        ("node[3-1]", "backwards"),
        ("node[a-b]", "numbers and ranges"),
        ("node[]", "numbers and ranges"),
        ("node[1--2]", "numbers and ranges"),
        ("a,,b", "empty host name"),
        ("a,", "empty host name"),
        ("no de", "characters"),
        ("a;rm", "characters"),
        ("a,a", "twice"),
        ("n[1-2],n2", "twice"),
        (f"n[1-{MAX_HOSTS + 1}]", "more than"),
        ("n[0-999]m[0-999]", "more than"),  # a product of ranges is capped before it is expanded
        ("n[1-999999999]", "more than"),
        ("n[1-9999999999]", "numbers and ranges"),  # ten digits
    ],
)
def test_a_malformed_host_list_is_refused_naming_it(text, why):
    with pytest.raises(ConfigError, match=why) as raised:
        expand_hosts(text, "SLURM_STEP_NODELIST")
    assert "SLURM_STEP_NODELIST" in str(raised.value)


def test_task_counts_expand_and_malformed_ones_are_refused():
    assert expand_counts("2(x3),1", "V") == [2, 2, 2, 1]
    assert expand_counts("1(x2)", "V") == [1, 1]
    assert expand_counts("16", "V") == [16]
    for text, why in [
        ("", "task counts"),
        ("0", "no task"),
        ("2(x0)", "no task"),
        ("x", "not a task count"),
        ("2(x3", "not a task count"),
        ("2(3)", "not a task count"),
        ("-1", "not a task count"),
        ("1,,1", "not a task count"),
        (f"1(x{MAX_HOSTS + 1})", "more than"),
        ("2(x60000)", "more than"),  # 120,000 tasks
    ]:
        with pytest.raises(ConfigError, match=why) as raised:
            expand_counts(text, "SLURM_STEP_TASKS_PER_NODE")
        assert "SLURM_STEP_TASKS_PER_NODE" in str(raised.value)


def test_block_and_cyclic_layouts():
    assert place(["a", "b"], [3, 2]) == ["a", "a", "a", "b", "b"]
    assert place(["a", "b", "c"], [2, 1, 3], "cyclic") == ["a", "b", "c", "a", "c", "c"]


def test_ports_of_several_tasks_per_node_do_not_collide():
    cluster = None
    for rank, (node, local) in enumerate([("node1", 0), ("node1", 1), ("node1", 2), ("node2", 0), ("node2", 1)]):
        environ = step("node[1-2]", "3,2", rank, SLURMD_NODENAME=node, SLURM_LOCALID=str(local))
        config = config_of(environ, slurm_ps=2, slurm_port=30000)
        assert cluster in (None, config.cluster)  # every task builds the same cluster
        cluster = config.cluster
        assert config.listed_address() == f"{NODES[node]}:{30000 + 2 * local}"
    assert cluster.to_dict() == {
        "ps": ["10.77.0.11:30000", "10.77.0.11:30002"],
        "chief": ["10.77.0.11:30004"],
        "worker": ["10.77.0.12:30000", "10.77.0.12:30002"],
    }
    ps1 = config_of(step("node[1-2]", "3,2", 1), slurm_ps=2, slurm_port=30000)
    assert (ps1.task.type, ps1.task.index, ps1.options.stream_port) == ("ps", 1, 30003)


def test_nodes_sharing_one_address_count_their_tasks_together():
    loopback = table({"node1": "127.0.0.1", "node2": "127.0.0.1"})
    config = config_of(step("node[1-2]", "2,2", 0), loopback, slurm_port=30000)
    assert config.cluster.to_dict() == {
        "ps": ["127.0.0.1:30000"],
        "chief": ["127.0.0.1:30002"],
        "worker": ["127.0.0.1:30004", "127.0.0.1:30006"],
    }
    assert bind_address(config.listed_address()) == "127.0.0.1:30000"  # loopback: the PS binds it alone


def test_a_cyclic_step_and_a_layout_slurm_did_not_make():
    # cyclic: ranks 0, 2 on node1; 1 on node2
    config = config_of(
        step("node[1-2]", "2,1", 2, SLURM_DISTRIBUTION="cyclic", SLURMD_NODENAME="node1", SLURM_GTIDS="0,2")
    )
    assert config.listed_address() == "10.77.0.11:20822"  # job 41: 20000 + 41 * 20, second task on node1
    assert (config.task.type, config.task.index) == ("worker", 0)
    for wrong in [{"SLURMD_NODENAME": "node2"}, {"SLURM_GTIDS": "0,1"}, {"SLURM_LOCALID": "0"}]:
        with pytest.raises(ConfigError, match="--distribution=block"):
            config_of(step("node[1-2]", "2,1", 2, SLURM_DISTRIBUTION="cyclic") | wrong)
    with pytest.raises(ConfigError, match="SLURM_DISTRIBUTION='plane=2'"):
        config_of(step("node[1-2]", "2,1", 0, SLURM_DISTRIBUTION="plane=2"))


def test_a_name_that_does_not_resolve_is_refused_naming_it():
    environ = step("localhost,nosuch-node.invalid", "1,1", 0)
    with pytest.raises(ConfigError, match=r"'nosuch-node\.invalid' does not resolve.*/etc/hosts"):
        slurm_config(environ, Options())  # the machine's own resolver
    with pytest.raises(ConfigError, match="'node3' does not resolve"):
        config_of(step("node[1-3]", "1(x3)", 0), table({"node1": "10.0.0.1", "node2": "10.0.0.2"}))


def test_the_machines_resolver_and_a_one_node_step():
    assert resolve_host("localhost") == "127.0.0.1"  # IPv4 first
    config = slurm_config(step("localhost", "3", 1, SLURM_JOB_ID="2041"), Options())
    port = 20000 + 41 * 20
    assert config.cluster.to_dict() == {
        "ps": [f"127.0.0.1:{port}"],
        "chief": [f"127.0.0.1:{port + 2}"],
        "worker": [f"127.0.0.1:{port + 4}"],
    }


def test_a_loopback_node_beside_others_is_refused():
    mixed = table({"node1": "127.0.1.1", "node2": "10.77.0.12"})
    with pytest.raises(ConfigError, match="'node1' resolves to the loopback address 127.0.1.1"):
        config_of(step("node[1-2]", "1,1", 0), mixed)


def test_a_stuck_resolver_has_a_deadline():
    release = threading.Event()

    def stuck(name):
        release.wait(10)
        return "10.0.0.1"

    try:
        with pytest.raises(ConfigError, match="took over"):
            resolve_nodes(["node1"], stuck, timeout_s=0.1)
    finally:
        release.set()


def test_ps_count_must_leave_a_worker():
    with pytest.raises(ConfigError, match="2 tasks and slurm_ps=2 makes 2 of them PS, leaving no worker"):
        config_of(step("node[1-2]", "1,1", 0), slurm_ps=2)
    with pytest.raises(ConfigError, match="slurm_ps=5"):
        config_of(step("node[1-2]", "1,1", 0), slurm_ps=5)
    with pytest.raises(ConfigError, match="slurm_ps"):
        Options(slurm_ps=0)


@pytest.mark.parametrize(
    "change, why",
    [
        ({"SLURM_PROCID": "2"}, "SLURM_PROCID must be a whole number up to 1"),
        ({"SLURM_PROCID": "-1"}, "SLURM_PROCID must be a whole number"),
        ({"SLURM_PROCID": "one"}, "SLURM_PROCID must be a whole number"),
        ({"SLURM_JOB_ID": "x"}, "SLURM_JOB_ID must be a whole number"),
        ({"SLURM_STEP_NUM_TASKS": "3"}, "SLURM_STEP_NUM_TASKS=3"),
        ({"SLURM_STEP_TASKS_PER_NODE": "1(x3)"}, "counts tasks on 3 nodes"),
        ({"SLURM_HET_SIZE": "9999"}, "SLURM_HET_SIZE must be a whole number up to"),
        ({"SLURM_RESTART_COUNT": "z"}, "SLURM_RESTART_COUNT"),
    ],
)
def test_bad_step_variables_are_refused_naming_them(change, why):
    with pytest.raises(ConfigError, match=why):
        config_of(TWO_NODE_STEP | change)


def test_ports_past_65535_are_refused():
    with pytest.raises(ConfigError, match="past 65535"):
        config_of(step("node1", "9", 0), slurm_port=65520)


def test_a_requeued_job_resumes_from_its_checkpoint(tmp_path):
    chief = TWO_NODE_STEP | {"SLURM_RESTART_COUNT": "1"}
    assert config_of(chief, checkpoint_dir=str(tmp_path)).options.resume
    assert not config_of(chief).options.resume  # nothing to resume from
    assert not config_of(TWO_NODE_STEP | {"SLURM_RESTART_COUNT": "0"}, checkpoint_dir=str(tmp_path)).options.resume


def test_options_are_checked_against_the_cluster():
    with pytest.raises(ConfigError, match="backup_workers"):
        config_of(TWO_NODE_STEP, mode="sync", backup_workers=1)  # one worker: none may be left out
    elastic = config_of(TWO_NODE_STEP, max_workers=4)
    assert elastic.num_workers == 4


def test_paramserver_node_takes_the_slurm_step_without_tf_config(monkeypatch):
    for name in (TF_CONFIG_ENV, "PARAMSERVER_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    assert not in_slurm_step({"SLURM_PROCID": "0"})  # a batch script: no step
    for name, value in step("localhost", "2", 1).items():
        monkeypatch.setenv(name, value)
    config = node_command.resolve(None, None, None, Options())
    assert config is not None and (config.task.type, config.task.index) == ("chief", 0)
    assert config.cluster.ps == (f"127.0.0.1:{20000 + 41 * 20}",)
    assert node_command.resolve(None, "ps", 0, Options()) is None  # a --role keeps its flags (paramserver run)
    tf_config = '{"cluster": {"ps": ["h:1"], "worker": ["h:2"]}, "task": {"type": "worker", "index": 0}}'
    monkeypatch.setenv(TF_CONFIG_ENV, tf_config)
    assert node_command.resolve(None, None, None, Options()).cluster.ps == ("h:1",)  # TF_CONFIG first
