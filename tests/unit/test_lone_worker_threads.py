"""A plain `python train.py` (no cluster, shards in-process) gets the launcher's choices: OpenMP's passive
wait from importing paramserver (base/omp_wait.py) and the idle cores as torch threads (launch/threads.py)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from paramserver.base import omp_wait
from paramserver.launch import threads
from paramserver.worker import cluster


@pytest.fixture
def reload_omp_wait(monkeypatch):
    """Imports base/omp_wait.py again under the test's environment; the original environment and module after."""
    for name in omp_wait.PASSIVE_WAIT_ENV:
        monkeypatch.setenv(name, "x")  # recorded, so that the test's changes are undone
        monkeypatch.delenv(name)
    yield lambda: importlib.reload(omp_wait)
    monkeypatch.undo()
    importlib.reload(omp_wait)


def test_importing_sets_the_passive_wait(reload_omp_wait):
    reload_omp_wait()
    assert {name: os.environ[name] for name in omp_wait.PASSIVE_WAIT_ENV} == dict(omp_wait.PASSIVE_WAIT_ENV)
    # torch is loaded in this process already: its OpenMP read no policy, and the module says so
    assert omp_wait.spinning_since_torch_loaded_first


def test_a_wait_policy_the_user_set_stands(reload_omp_wait, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    reload_omp_wait()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "GOMP_SPINCOUNT" not in os.environ and "KMP_BLOCKTIME" not in os.environ
    assert not omp_wait.spinning_since_torch_loaded_first


def test_lone_worker_threads_are_the_idle_cores(monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads.psutil, "cpu_percent", lambda interval, percpu: [95.0, 5.0])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.lone_worker_threads(os.environ) == 1  # one core busy elsewhere
    monkeypatch.setattr(threads.psutil, "cpu_percent", lambda interval, percpu: [5.0, 5.0])
    assert threads.lone_worker_threads(os.environ) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.lone_worker_threads(os.environ) == 0  # the user's count: torch's default stands


@pytest.mark.parametrize(("user_changed", "expected"), [(False, [1]), (True, [])])
def test_the_in_process_cluster_applies_the_choice(monkeypatch, fresh_context, user_changed, expected):
    import paramserver as ps

    chosen: list[int] = []
    monkeypatch.setattr(cluster.torch, "set_num_threads", chosen.append)
    # torch's default, as this process sees it (conftest runs tests on one thread); or a count the script set
    default = torch.get_num_threads() + (1 if user_changed else 0)
    monkeypatch.setattr(cluster, "_default_threads", lambda: default)
    monkeypatch.setattr(threads, "measure", lambda workers: threads.choose(workers, 2, 0.9, {}))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ps.init()
    assert chosen == expected
