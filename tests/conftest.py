"""Shared fixtures: real PS processes on 127.0.0.1 port 0, and cleanup of everything a test started.
The fast tier's guard: a test not marked `cluster` or `fault` that starts a process fails (tests/spawn_guard.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from tests import spawn_guard, tiers

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]

# OpenMP threads that wait for work sleep instead of spinning, here and in every process a test starts
# (they inherit it). Spinning threads are idle work that competes for the cores with everything else:
# examples/digits.py took 26-31 s beside two busy loops, 14-16 s with this (and a third of the CPU). It
# changes no result, only how idle threads wait. Read when torch loads, which is after this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_GUARD = pytest.StashKey[spawn_guard.Guard]()
# The engines tier (tests/engines): real schedulers (a Slurm cluster in network namespaces). Its tests start
# processes and daemons; `make test-all` runs them in a pytest process of their own (one cluster at a time).
ENGINES = "engines"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{ENGINES}: a real scheduler (Slurm daemons, network namespaces); starts processes, one at a time"
    )

# The folders mirror the tiers (tests/tiers.py): when on, a collected test in the wrong folder stops the
# session before any test runs, naming each. Off until every file sits in its tier's folder.
TIER_FOLDERS_CHECKED = True


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Before `-m` deselects anything, so a run of one tier still checks every test it collected."""
    _longest_first(items)
    if not TIER_FOLDERS_CHECKED:
        return
    wrong = tiers.misplaced_tests(items, ROOT / "tests")
    if wrong:
        raise pytest.UsageError(f"{len(wrong)} test(s) in the wrong tier folder "
                                f"(tests/unit: the fast tier; tests/integration, tests/fault: cluster, parity, "
                                f"fault; tests/engines: engines; tests/net: net):\n  " + "\n  ".join(wrong))


# The longest tests (pytest --durations in CI), started first: a worker that draws one of them last holds the
# whole run up by its length. `make test-all` hands tests out with xdist's worksteal, which keeps this order
# within each worker's share; the fast tests fill in behind.
LONGEST_FIRST = (
    "tests/fault/test_lifecycle.py::test_digits_in_sync_mode_with_a_backup_worker_passes_ten_runs_of_ten",
    "tests/fault/test_lifecycle.py::test_a_run_finishes_by_itself_whatever_the_order_of_starts_finishes_and_kills",
    "tests/integration/test_checkpoint_triggers.py::test_the_chiefs_step_count_and_clock_make_one_barrier_every_worker_meets",
    "tests/fault/test_in_cluster_recovery.py::test_a_cluster_under_restart_loops_recovers_from_a_ps_the_chief_and_a_worker_killed",
    "tests/fault/test_chaos.py::test_killing_a_worker_a_ps_and_the_chief_costs_no_accuracy",
    "tests/fault/test_lifecycle.py::test_the_ctr_example_survives_a_killed_ps_then_a_killed_worker_at_the_same_auc",
    "tests/integration/test_dataloader_workers.py::test_spawned_dataloader_workers_reimport_the_script_and_deliver_every_sample_in_every_mode",
    "tests/fault/test_dispatched_data.py::test_workers_join_one_is_killed_one_leaves_and_only_the_killed_ones_last_batches_repeat",
)


def _longest_first(items) -> None:
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("[")[0], len(rank)))  # stable: the rest keep their order


def _guarded(item):
    """Runs one phase of a test (set-up, call, teardown) with process starts refused, unless the
    test is marked `cluster`, `fault` (tests/spawn_guard.py) or `engines`. A hook wrapper's body."""
    guard = None
    if not spawn_guard.allows_spawning(item) and item.get_closest_marker(ENGINES) is None:
        guard = item.stash.setdefault(_GUARD, spawn_guard.Guard(item.nodeid))
        guard.install()
    try:
        return (yield)
    finally:
        if guard is not None:
            guard.uninstall()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A refused process start fails the test even where its code swallowed the exception."""
    report = yield
    guard = item.stash.get(_GUARD, None)
    failure = guard.failure() if guard is not None else None
    if failure is not None and not report.skipped:
        if report.passed:
            report.outcome = "failed"
            report.longrepr = failure
        else:
            report.sections.append(("spawn guard", failure))
    return report


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill a process we started and its process group (nodes run in their own session)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    proc.wait(10)


class Procs:
    """Processes a test started; all are killed at teardown, even when the test failed."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []
        self.tag = uuid.uuid4().hex  # in the environment of everything started, to find leftovers

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PARAMSERVER_OPTIONS")}
        env.update(PARAMSERVER_TEST_TAG=self.tag, PYTHONUNBUFFERED="1", **extra)
        return env

    def start(self, argv: list[str], **kwargs) -> subprocess.Popen:
        kwargs.setdefault("env", self.env())
        proc = subprocess.Popen(argv, start_new_session=True, cwd=ROOT, **kwargs)
        self.started.append(proc)
        return proc

    def start_ps(self, index: int = 0, bind: str = "127.0.0.1:0", **env: str) -> tuple[subprocess.Popen, str]:
        """A real PS node process; returns it and its announced address."""
        proc = self.start([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "node", "--role", "ps",
                           "--index", str(index), "--bind", bind], stdout=subprocess.PIPE, text=True,
                          env=self.env(**env))
        line = proc.stdout.readline()
        if not line.startswith("PARAMSERVER_READY"):
            raise RuntimeError(f"PS did not start: {line!r}")
        return proc, line.split()[-1]

    def leftovers(self) -> list[psutil.Process]:
        """Live processes (other than this one) carrying this test's tag."""
        found = []
        for proc in psutil.process_iter():
            try:
                if proc.pid != os.getpid() and proc.environ().get("PARAMSERVER_TEST_TAG") == self.tag:
                    if proc.status() != psutil.STATUS_ZOMBIE:
                        found.append(proc)
            except psutil.Error:
                continue
        return found

    def cleanup(self) -> None:
        for proc in self.started:
            _kill_tree(proc)
        for proc in self.leftovers():
            proc.kill()


@pytest.fixture(autouse=True)
def one_torch_thread():
    """torch in this process runs one intra-op thread: the models here are small, and on a machine whose
    cores are busy (other tests' nodes, CI's load) torch's thread pool spends its time waiting for a core,
    several times slower than one thread. Both sides of every comparison run in this process alike;
    the nodes a test starts keep their own settings."""
    import torch

    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture
def procs():
    tracker = Procs()
    yield tracker
    tracker.cleanup()


@pytest.fixture(params=["c", "numpy"])
def both_kernel_paths(request, monkeypatch):
    """Runs a test once with the PS's C kernels (skipped if not built) and once on numpy."""
    from paramserver.base import kernels

    if request.param == "numpy":
        monkeypatch.setattr(kernels, "KERNELS", None)
    elif kernels.KERNELS is None:
        pytest.skip("C kernels not built")
    return request.param


@pytest.fixture
def fresh_context():
    """Leaves no paramserver context behind for the next test."""
    from paramserver.worker import current

    yield
    if current.existing() is not None:
        current.existing().shutdown()
    current.set_launched_config(None)
