"""The launcher's choice of a worker's torch threads and of its OpenMP wait policy (launch/threads.py)."""

import pytest

from paramserver.launch.threads import PASSIVE_WAIT_ENV, choose, choose_torch_threads, wait_policy_env


@pytest.mark.parametrize(
    ("cores", "workers", "busy", "threads"),
    [
        (2, 1, 0.0, 2),  # a quiet machine: the worker may use the PS's core while it waits
        (2, 1, 0.3, 2),  # a little background work rounds away
        (2, 1, 0.8, 1),  # one core busy elsewhere
        (2, 1, 2.0, 1),  # both busy: never fewer than one
        (2, 1, 7.5, 1),
        (2, 2, 0.0, 1),
        (8, 2, 0.0, 4),
        (8, 2, 3.2, 2),  # 5 idle cores, 2 workers
        (8, 3, 0.0, 2),
        (1, 4, 0.0, 1),
        (4, 1, -1.0, 4),  # a sample can not make more cores than there are
    ],
)
def test_threads_share_the_idle_cores(cores, workers, busy, threads):
    assert choose_torch_threads(cores, workers, busy) == threads


def test_no_workers_is_refused():
    with pytest.raises(ValueError, match="at least 1 worker"):
        choose_torch_threads(2, 0, 0.0)


def test_passive_wait_unless_the_environment_chose():
    assert wait_policy_env({}) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}
    assert wait_policy_env({"PATH": "/bin"}) == dict(PASSIVE_WAIT_ENV)
    for name in PASSIVE_WAIT_ENV:  # any one of them set by the user: theirs stands, none added
        assert wait_policy_env({name: "ACTIVE" if name == "OMP_WAIT_POLICY" else "200"}) == {}


def test_choose_combines_both():
    choice = choose(num_workers=1, cores=2, busy_cores=2.0, environ={})
    assert choice.torch_threads == 1 and choice.env["OMP_WAIT_POLICY"] == "PASSIVE"
    choice = choose(num_workers=1, cores=2, busy_cores=0.0, environ={"OMP_WAIT_POLICY": "ACTIVE"})
    assert choice.torch_threads == 2 and not choice.env


def test_the_local_launcher_puts_it_in_each_childs_environment(monkeypatch):
    from paramserver.base.config import Options
    from paramserver.launch.local.supervisor import LocalCluster

    for name in PASSIVE_WAIT_ENV:
        monkeypatch.delenv(name, raising=False)
    cluster = LocalCluster(1, 1, "train.py", options=Options(torch_threads=1))
    assert cluster._env(cluster.options)["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    env = cluster._env(cluster.options)
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in env


def test_measure_counts_only_this_process_cores(monkeypatch):
    from paramserver.launch import threads

    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads.psutil, "cpu_percent", lambda interval, percpu: [10.0, 5.0, 100.0, 100.0])
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert threads.usable_cores() == [0, 1]
    assert threads.measure(1).torch_threads == 2  # cores 2 and 3 are busy, but not ours
    monkeypatch.setattr(threads.psutil, "cpu_percent", lambda interval, percpu: [95.0, 5.0, 0.0, 0.0])
    assert threads.measure(1).torch_threads == 1
