"""Ray, for real: a head and two worker nodes on 127.0.0.1 (tests/engines/ray_cluster.py) run a script through
`paramserver.ray.run` and `paramserver run --engine ray`: PS and workers are Ray actors spread one per node, the
output, progress and closing JSON line are the local launcher's, the CTR example trains to the held-out AUC of
`paramserver run`; a worker whose Ray node is lost mid-run is started again on another node, and a PS whose Ray
node is lost comes back on another in a roll-back to the latest checkpoint; both runs finish with every batch
applied exactly once."""

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

from paramserver.launch.local.run_files import RUN_DIR_ENV

pytestmark = pytest.mark.engines

CTR = str(ROOT / "examples" / "ctr.py")
CTR_DATA = str(ROOT / "examples" / "ctr_data.py")
COUNTED = str(ROOT / "tests" / "integration" / "scripts" / "train_counted.py")
ELASTIC = str(ROOT / "tests" / "integration" / "scripts" / "elastic_counted.py")
PLACED = re.compile(r"^\[run\] on Ray: (.*)$", re.M)
# the workers on nodes that may be lost (their custom resource: not the head, the driver's); the PS, spread, anywhere
RESOURCES = {"ps": {"CPU": 1}, "worker": {"CPU": 1, "spare": 0.01}}


@pytest.fixture(scope="module")  # gone before the engines tier's next module starts its own cluster
def ray_lab():
    lab = ray_cluster.start()
    try:
        yield lab
    finally:
        ray_cluster.stop(lab)


def _run(lab, script: str, args: list[str], **options) -> tuple[int, str, dict]:
    """A run to its end: exit code, output, closing record."""
    driver = _Driver(lab, script, args, RESOURCES, **options)
    driver.join(300)
    text = driver.finish()
    return driver.code or 0, text, json.loads(text.strip().splitlines()[-1])


def _placed(text: str, which: int = 0) -> dict[str, str]:
    """Each node's Ray node id prefix, from the run's `which`-th "on Ray:" line (a roll-back places them again)."""
    line = PLACED.findall(text)[which]
    return dict(entry.split("@")[0:1] + [entry.split("/")[1]] for entry in line.split(", "))


@pytest.fixture(scope="module")
def ctr_data(tmp_path_factory) -> list[str]:
    """Small synthetic Criteo-format data (examples/ctr_data.py): the CTR example's arguments to read it."""
    folder = tmp_path_factory.mktemp("ctr")
    paths = {}
    for name, rows, seed in (("train", 12_000, 1), ("test", 4_000, 2)):
        paths[name] = str(folder / f"{name}.tsv")
        subprocess.run(
            [
                sys.executable,
                CTR_DATA,
                "--rows",
                str(rows),
                "--vocab",
                "50000",
                "--seed",
                str(seed),
                "--out",
                paths[name],
            ],
            check=True,
            timeout=120,
        )
    return ["--train", paths["train"], "--test", paths["test"], "--batch-size", "128", "--table-rows", "100000"]


def test_the_ctr_example_trains_on_ray_to_the_auc_of_paramserver_run(ray_lab, ctr_data):
    """examples/ctr.py, 1 PS and 2 workers in sync mode (the same data, seed and order: a deterministic AUC)."""
    local = subprocess.run(
        [sys.executable, "-m", "paramserver", "run", "--ps", "1", "--workers", "2", "--mode", "sync"]
        + ["--torch-threads", "1", "--progress-every", "0", CTR, *ctr_data],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert local.returncode == 0, local.stdout + local.stderr
    reference = json.loads(local.stdout.strip().splitlines()[-1])["test_auc"]

    started = time.monotonic()
    code, text, summary = _run(ray_lab, CTR, ctr_data, mode="sync")
    print(f"ray run {time.monotonic() - started:.1f}s: {summary}; paramserver run's AUC {reference}")
    assert code == 0, text
    assert abs(summary["test_auc"] - reference) <= 0.01, (summary, reference)
    assert summary["engine"] == "ray" and summary["ps"] == 1 and summary["workers"] == 2
    assert summary["examples"] == 12_000 and summary["steps"] > 0 and summary["wall_s"] > 0, summary
    placed = _placed(text)
    assert len(set(placed.values())) == 3, placed  # STRICT_SPREAD: one node per Ray node
    for label in ("ps0", "worker0", "worker1"):
        assert f"[{label}] " in text
    assert "[worker0] held-out AUC" in text and "[run] steps=" in text


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


def test_an_elastic_run_takes_a_worker_on_a_ray_node_that_joined_then_lets_it_leave(ray_lab, tmp_path, monkeypatch):
    """max_workers 3, 2 workers started, each filling a Ray node (2 CPUs): a node joins the Ray cluster,
    `paramserver scale 3` starts worker2 there (nowhere else has room), `paramserver scale 2` asks it to leave;
    the run trains on and finishes, every batch a worker reported applied exactly once."""
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o700)
    monkeypatch.setenv(RUN_DIR_ENV, str(runs))  # the driver's run file, where `paramserver scale` looks
    cells, stop = tmp_path / "cells.json", tmp_path / "stop"

    def scale(workers: int) -> None:
        env = {**os.environ, RUN_DIR_ENV: str(runs)}
        done = subprocess.run(
            [sys.executable, "-m", "paramserver", "scale", str(workers)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    driver = _Driver(
        ray_lab,
        ELASTIC,
        ["--batches", "1000", "--pace", "0.05", "--stop", str(stop), "--out", str(cells)],
        {"ps": {"CPU": 1}, "worker": {"CPU": 2, "spare": 0.01}},
        max_workers=3,
    )
    out = driver.out
    joined = None
    try:
        out.wait_for("[worker1] batch 1 10 ", 60)
        joined = ray_lab.cluster.add_node(**ray_cluster.WORKER_NODE)
        ray_lab.cluster.wait_for_nodes()
        scale(3)
        out.wait_for("[worker2] batch 2 10 ", 60)
        scale(2)
        out.wait_for("[run] worker2 left the run", 60)
        out.wait_for("[worker1] batch 1 80 ", 60)  # the others trained on
    finally:
        stop.touch()
        driver.join(120)
    text = driver.finish()
    assert joined is not None and f"[run] worker2 on Ray: 127.0.0.1/{joined.node_id[:8]}" in text, text
    assert "[run] scaling to 3 workers: started [2], asked to leave []" in text, text
    assert "[run] scaling to 2 workers: started [], asked to leave [2]" in text, text
    summary = json.loads(text.strip().splitlines()[-1])
    events = [(event["worker"], event["event"]) for event in summary["membership"]]
    started = [(0, "started"), (1, "started"), (2, "started")]
    assert summary["max_workers"] == 3 and events == [*started, (2, "asked to leave"), (2, "left")], summary
    applied = json.loads(cells.read_text())
    reported = {(int(w), int(b)) for w, b in re.findall(r"^\[worker\d\] batch (\d) (\d+) ", text, re.M)}
    marked = {(w, b) for w, row in enumerate(applied) for b, value in enumerate(row) if value}
    assert {value for row in applied for value in row} <= {0.0, 1.0}, applied  # none applied twice
    # every batch reported was applied; a step cut short by its worker's leave may be applied unreported
    assert reported and reported <= marked and len(marked - reported) <= 1, (sorted(marked - reported), text)
    # the node that joined stays: the tests after it lose one


def test_a_worker_whose_ray_node_is_lost_rejoins_on_another(ray_lab, tmp_path):
    """worker1's Ray node dies (its raylet and every process under it SIGKILLed): Ray reports its actor dead, the
    engine starts worker1 again in a new actor elsewhere, it resumes at its position and the run finishes."""
    cells = tmp_path / "cells.json"
    driver = _Driver(ray_lab, COUNTED, ["--batches", "80", "--pace", "0.1", "--out", str(cells)], RESOURCES)
    out = driver.out
    try:
        out.wait_for("[worker1] worker 1 at batch 20", 60)
        victim = _kill_ray_node(ray_lab, _placed(out.getvalue())["worker1"])
    finally:
        driver.join(120)
    text = driver.finish()
    assert re.search(r"\[run\] worker1 was lost with its Ray actor .*restarting it alone", text), text
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["restarts"] == 1, text
    assert json.loads(cells.read_text()) == [[1.0] * 80, [1.0] * 80], text  # every batch applied once, none redone
    ray_lab.cluster.remove_node(victim, allow_graceful=False)  # the tests after it find one node fewer


def test_a_killed_ps_is_restored_alone_on_its_ray_node_under_partial_recovery(ray_lab, tmp_path):
    """ps0's node process is SIGKILLed, its Ray node lives on: under recovery "partial" the engine starts ps0 again
    in a new actor on that Ray node, on its address, from its newest checkpoint; the workers go on. Its shard
    lost exactly the batches each worker was told of, and no batch was applied twice."""
    cells = tmp_path / "cells.json"
    options = {"mode": "async", "recovery": "partial", "checkpoint_dir": str(tmp_path / "ckpt"), "checkpoint_every": 20}
    driver = _Driver(
        ray_lab,
        COUNTED,
        ["--batches", "60", "--pace", "0.1", "--out", str(cells)],
        {"ps": {"CPU": 1, "spare": 0.01}, "worker": {"CPU": 1}},
        **options,
    )
    out = driver.out
    try:
        out.wait_for(": committed", 60)
        out.wait_for("[worker1] worker 1 at batch 30", 60)
        node_id = _placed(out.getvalue())["ps0"]
        raylet = _raylet(ray_lab, node_id)
        [ps] = [p for p in raylet.children(recursive=True) if "--role" in p.cmdline() and "ps" in p.cmdline()]
        ps.kill()
        print(f"killed ps0's process {ps.pid} at {time.strftime('%X')}")
    finally:
        driver.join(120)
    text = driver.finish()
    restored = rf"\[run\] ps0 was killed \(signal 9\); restoring shard 0 alone.* \(Ray node {node_id}\)"
    assert re.search(restored, text), text  # on its Ray node, on its address
    assert "rolling the whole cluster back" not in text and text.count(" starts at batch ") == 2, text  # none restarted
    summary = json.loads(text.strip().splitlines()[-1])
    [recovery] = summary["partial_recoveries"]
    assert summary["restarts"] == 1 and "steps_redone" not in summary, summary
    lost = {w: [b for b, v in enumerate(row) if v == 0.0] for w, row in enumerate(json.loads(cells.read_text()))}
    assert {v for row in json.loads(cells.read_text()) for v in row} <= {0.0, 1.0}, text  # none applied twice
    assert {str(w): len(b) for w, b in lost.items() if b} == {w: n for w, n in recovery["by_worker"].items() if n}


def test_a_ps_whose_ray_node_is_lost_comes_back_on_another_and_the_cluster_rolls_back(ray_lab, tmp_path):
    """ps0's Ray node dies mid-run (its raylet and every process under it SIGKILLed): with a checkpoint_dir the
    engine places every node again on the Ray nodes left, ps0 on another, all from the latest checkpoint, and
    the run finishes with every batch applied exactly once (the steps after the checkpoint trained again)."""
    cells = tmp_path / "cells.json"
    driver = _Driver(
        ray_lab,
        COUNTED,
        ["--batches", "60", "--pace", "0.08", "--out", str(cells)],
        {"ps": {"CPU": 1, "spare": 0.01}, "worker": {"CPU": 1}},  # the PS on a node that may go
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every=20,
    )
    out = driver.out
    try:
        out.wait_for(": committed", 60)
        out.wait_for("[worker1] worker 1 at batch 30", 60)
        node_id = _placed(out.getvalue())["ps0"]
        victim = _kill_ray_node(ray_lab, node_id)
    finally:
        driver.join(150)
    text = driver.finish()
    # named once Ray reports its actor dead; the workers, which saw it go first, ask for the roll-back meanwhile
    assert re.search(r"\[run\] (ps0 was lost with its Ray actor|worker\d exited with code 75).*rolling the whole", text)
    assert "[run] cluster restarted in" in text, text
    assert _placed(text, 1)["ps0"] != node_id, text  # placed again, on a Ray node alive
    summary = json.loads(text.strip().splitlines()[-1])
    assert summary["restarts"] == 1 and summary["steps_redone"] > 0, summary
    assert json.loads(cells.read_text()) == [[1.0] * 60, [1.0] * 60], text  # every batch applied exactly once
    ray_lab.cluster.remove_node(victim, allow_graceful=False)  # the tests after it find one node fewer


def _raylet(lab, node_id: str) -> psutil.Process:
    """The raylet of the worker node whose id starts with `node_id` (every process of the node is below it)."""
    node = next(node for node in lab.cluster.worker_nodes if node.node_id.startswith(node_id))
    return psutil.Process(node.all_processes["raylet"][0].process.pid)


def _kill_ray_node(lab, node_id: str):
    """SIGKILL the raylet of the worker node whose id starts with `node_id` and every process under it."""
    victim = next(node for node in lab.cluster.worker_nodes if node.node_id.startswith(node_id))
    raylet = _raylet(lab, node_id)
    for process in [raylet, *raylet.children(recursive=True)]:
        process.kill()
    print(f"killed Ray node {node_id} at {time.strftime('%X')}")
    return victim


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


class _Driver:
    """`paramserver.ray.run(script, args, 1 PS, 2 workers)` on a thread of its own, its output in `out`: the test
    acts on the run while it trains, then `finish` joins it and gives its output (asserting that it ended)."""

    def __init__(self, lab, script: str, args: list[str], resources: dict, **options) -> None:
        self.out = _Stream()
        self.code: int | None = None
        self._thread = threading.Thread(
            target=self._drive, args=(lab, script, args, resources, options), name="ray-driver"
        )
        self._thread.start()

    def _drive(self, lab, script: str, args: list[str], resources: dict, options: dict) -> None:
        import paramserver
        from paramserver.base.config import Options

        self.code = paramserver.ray.run(
            script,
            args,
            num_ps=1,
            num_workers=2,
            options=Options(torch_threads=1, **options),
            address=lab.address,
            resources=resources,
            out=self.out,
            progress_every=1.0,
        )

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def finish(self) -> str:
        """The run's output, once it ended (the caller joined it) with exit code 0; its `[run]` lines printed."""
        text = self.out.getvalue()
        print("\n".join(line for line in text.splitlines() if line.startswith("[run]") and "steps=" not in line))
        assert not self._thread.is_alive(), text
        assert self.code == 0, text
        return text
