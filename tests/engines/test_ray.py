"""Ray, for real: a head and two worker nodes on 127.0.0.1 (tests/engines/ray_cluster.py) run a script through
`paramserver.ray.run` and `paramserver run --engine ray`: PS and workers are Ray actors spread one per node, the
output, progress and closing JSON line are the local launcher's, it trains as `paramserver run` does, and a
worker whose Ray node is lost mid-run is started again on another node and the run finishes."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import time

import psutil
import pytest
from tests.conftest import ROOT
from tests.engines import ray_cluster

pytestmark = pytest.mark.engines

DIGITS = str(ROOT / "examples" / "digits.py")
COUNTED = str(ROOT / "tests" / "integration" / "scripts" / "train_counted.py")
PLACED = re.compile(r"^\[run\] on Ray: (.*)$", re.M)
# the workers on the two nodes that may be lost (their custom resource); the PS, spread, on the head
RESOURCES = {"ps": {"CPU": 1}, "worker": {"CPU": 1, "spare": 0.01}}


@pytest.fixture(scope="module")  # gone before the engines tier's next module starts its own cluster
def ray_lab():
    lab = ray_cluster.start()
    try:
        yield lab
    finally:
        ray_cluster.stop(lab)


def _run(lab, script: str, args: list[str], **options) -> tuple[int, str, dict]:
    import paramserver
    from paramserver.base.config import Options

    out = io.StringIO()
    code = paramserver.ray.run(
        script,
        args,
        num_ps=1,
        num_workers=2,
        options=Options(torch_threads=1, **options),
        address=lab.address,
        resources=RESOURCES,
        out=out,
        progress_every=1.0,
    )
    text = out.getvalue()
    return code, text, json.loads(text.strip().splitlines()[-1])


def _placed(text: str) -> dict[str, str]:
    """Each node's Ray node id prefix, from the run's "on Ray:" line."""
    return dict(entry.split("@")[0:1] + [entry.split("/")[1]] for entry in PLACED.search(text)[1].split(", "))


def test_digits_trains_on_ray_as_with_paramserver_run(ray_lab):
    args = ["--epochs", "3"]
    local = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserver",
            "run",
            "--ps",
            "1",
            "--workers",
            "2",
            "--mode",
            "sync",
            "--torch-threads",
            "1",
            "--progress-every",
            "0",
            DIGITS,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert local.returncode == 0, local.stdout + local.stderr
    reference = json.loads(local.stdout.strip().splitlines()[-1])["test_accuracy"]

    started = time.monotonic()
    code, text, summary = _run(ray_lab, DIGITS, args, mode="sync")
    print(f"ray run {time.monotonic() - started:.1f}s: {summary}; paramserver run's accuracy {reference}")
    assert code == 0, text
    assert abs(summary["test_accuracy"] - reference) <= 0.01, (summary, reference)
    assert summary["engine"] == "ray" and summary["ps"] == 1 and summary["workers"] == 2
    assert summary["steps"] > 0 and summary["examples"] > 0 and summary["wall_s"] > 0
    placed = _placed(text)
    assert len(set(placed.values())) == 3, placed  # STRICT_SPREAD: one node per Ray node
    for label in ("ps0", "worker0", "worker1"):
        assert f"[{label}] " in text
    assert "[worker0] test accuracy" in text and "[run] steps=" in text


def test_cli_engine_ray_applies_every_batch_exactly_once(ray_lab, tmp_path):
    cells = tmp_path / "cells.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PARAMSERVER_OPTIONS")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "paramserver",
            "run",
            "--engine",
            "ray",
            "--address",
            ray_lab.address,
            "--ps",
            "1",
            "--workers",
            "2",
            COUNTED,
            "--batches",
            "30",
            "--pace",
            "0.01",
            "--out",
            str(cells),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["engine"] == "ray" and summary["examples"] == 60, summary
    assert json.loads(cells.read_text()) == [[1.0] * 30, [1.0] * 30]


def test_a_worker_whose_ray_node_is_lost_rejoins_on_another(ray_lab, tmp_path):
    """worker1's Ray node dies (its raylet and every process under it SIGKILLed): Ray reports its actor dead, the
    engine starts worker1 again in a new actor elsewhere, it resumes at its position and the run finishes."""
    cells = tmp_path / "cells.json"
    out = _Stream()
    result: dict = {}

    def drive() -> None:
        import paramserver
        from paramserver.base.config import Options

        result["code"] = paramserver.ray.run(
            COUNTED,
            ["--batches", "80", "--pace", "0.1", "--out", str(cells)],
            num_ps=1,
            num_workers=2,
            options=Options(torch_threads=1),
            address=ray_lab.address,
            resources=RESOURCES,
            out=out,
        )

    driver = threading.Thread(target=drive, name="ray-driver")
    driver.start()
    try:
        out.wait_for("[worker1] worker 1 at batch 20", 60)
        node_id = _placed(out.getvalue())["worker1"]
        victim = next(node for node in ray_lab.cluster.worker_nodes if node.node_id.startswith(node_id))
        raylet = psutil.Process(victim.all_processes["raylet"][0].process.pid)
        for process in [raylet, *raylet.children(recursive=True)]:
            process.kill()
        print(f"killed Ray node {node_id} (worker1's) at {time.strftime('%X')}")
    finally:
        driver.join(120)
    text = out.getvalue()
    assert not driver.is_alive(), text
    assert result["code"] == 0, text
    assert re.search(r"\[run\] worker1 was lost with its Ray actor .*restarting it alone", text), text
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["restarts"] == 1, text
    assert json.loads(cells.read_text()) == [[1.0] * 80, [1.0] * 80], text  # every batch applied once, none redone
    ray_lab.cluster.remove_node(victim, allow_graceful=False)
    ray_lab.cluster.add_node(**ray_cluster.WORKER_NODE)  # the next test finds three nodes again


class _Stream(io.StringIO):
    """A StringIO a test can wait on for a line. Thread-safe as the engine uses it (one writer at a time)."""

    def __init__(self) -> None:
        super().__init__()
        self._grew = threading.Condition()

    def write(self, text: str) -> int:
        with self._grew:
            written = super().write(text)
            self._grew.notify_all()
        return written

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._grew:
            while needle not in self.getvalue():
                if time.monotonic() > deadline:
                    raise AssertionError(f"no {needle!r} within {timeout}s:\n{self.getvalue()}")
                self._grew.wait(0.5)
