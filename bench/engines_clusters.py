"""The clusters bench/engines.py measures on: a Ray cluster and a Slurm cluster, each real, on this machine.

RayLab: a head and two worker nodes, every one on 127.0.0.1 with 2 CPUs (ray.cluster_utils.Cluster, as
tests/engines/ray_cluster.py does), started in this process; `stop()` shuts every Ray process down and
removes its temp dir. SlurmLab: munged, slurmctld and two slurmd "hosts", each in a network namespace with
its own name and address (tests/engines/slurm_cluster.sh in netns mode, as tests/engines/conftest.py does,
with names, addresses and ports of its own); `stop()` stops every daemon by PID, removes the namespaces and
its folder. Neither is thread-safe: start, use and stop each from one thread.

The Slurm job's tasks run through an interpreter wrapper the lab writes (`python`): it opens the progress
channel a launcher would give a worker (a file per task, fd 9, option `progress_fd`) and sets one torch
thread, as the other engines' runs get, before it execs the virtualenv's Python. The sbatch script itself is
the one `paramserver slurm` writes, unchanged.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
SLURM_SCRIPT = ROOT / "tests" / "engines" / "slurm_cluster.sh"
RAY_NODE = {"node_ip_address": "127.0.0.1", "num_cpus": 2, "object_store_memory": 80 << 20}
SLURM_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
PROGRESS_FD = 9
WRAPPER = """#!/bin/sh
# bench/engines.py's interpreter for the job's tasks: the progress channel (fd {fd}) and one torch thread
exec {fd}>>"$ENGINES_PROGRESS/task-$SLURM_PROCID.jsonl"
PARAMSERVER_OPTIONS="{{\\"progress_fd\\": {fd}, \\"torch_threads\\": 1, ${{PARAMSERVER_OPTIONS#\\{{}}"
export PARAMSERVER_OPTIONS
exec {python} "$@"
"""


@dataclass
class RayLab:
    """A Ray cluster of three nodes on 127.0.0.1: `address` (its GCS) for `paramserver run --engine ray`."""

    address: str = ""
    started_s: float = 0.0  # seconds the start took
    _cluster: Any = None
    _tmp: str = ""

    def start(self) -> RayLab:
        # before ray is imported: a cluster on loopback stays there (see tests/engines/ray_cluster.py)
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        from ray.cluster_utils import Cluster

        began = time.monotonic()
        self._tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: AF_UNIX socket paths live below it
        os.environ["RAY_TMPDIR"] = self._tmp  # the drivers this process starts inherit it
        self._cluster = Cluster(initialize_head=True, head_node_args={**RAY_NODE, "include_dashboard": False})
        for _ in range(2):  # one at a time: two nodes joining at once can time out on a small machine
            self._cluster.add_node(**RAY_NODE)
        self._cluster.wait_for_nodes()
        self.address = self._cluster.address
        self.started_s = time.monotonic() - began
        return self

    def stop(self) -> None:
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = ""


@dataclass
class SlurmJob:
    """A submitted job: its id, its output file, the folder of its tasks' progress files."""

    job_id: str
    output: Path
    progress: Path
    submitted: float  # unix time just before sbatch


@dataclass
class SlurmLab:
    """A two-node Slurm cluster (nodes psb1 and psb2 on 10.79.0.0/24, slurmctld on port 18817)."""

    lab: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ps-slurm-bench-")))
    env: dict[str, str] = field(default_factory=dict)
    started_s: float = 0.0
    _running: bool = False

    def __post_init__(self) -> None:
        self.lab.chmod(0o755)  # the munge socket's folder must be reachable
        self.env = {
            **os.environ,
            "SLURM_LAB": str(self.lab),
            "SLURM_LAB_MODE": "netns",
            "SLURM_LAB_NAME": "psb",
            "SLURM_LAB_NET": "10.79.0",
            "SLURM_LAB_PORT": "18817",
            "SLURM_CONF": str(self.lab / "etc" / "slurm.conf"),
        }
        for key in ("TF_CONFIG", "PARAMSERVER_OPTIONS", "PARAMSERVER_CLUSTER"):
            self.env.pop(key, None)

    def start(self, python: str) -> SlurmLab:
        """Install Slurm if it is missing, start the cluster, write the tasks' interpreter wrapper."""
        if not shutil.which("slurmctld"):
            self._script("install", timeout=600)
        began = time.monotonic()
        self._running = True  # from here on, stop() has something to stop even if the start fails
        self._script("start", timeout=120)
        self.started_s = time.monotonic() - began
        wrapper = self.lab / "python"
        wrapper.write_text(WRAPPER.format(fd=PROGRESS_FD, python=python))
        wrapper.chmod(0o755)
        return self

    @property
    def python(self) -> str:
        return str(self.lab / "python")

    def submit(self, script: Path) -> SlurmJob:
        folder = script.parent
        progress = folder / "progress"
        progress.mkdir()
        env = {**self.env, "ENGINES_PROGRESS": str(progress)}
        submitted = time.time()
        job_id = self._run(["sbatch", "--parsable", f"--output={folder}/out-%j.txt", str(script)], env=env)
        job_id = job_id.strip().split(";")[0]
        return SlurmJob(job_id, folder / f"out-{job_id}.txt", progress, submitted)

    def wait(self, job: SlurmJob, timeout: float) -> tuple[str, float]:
        """Poll until the job ended: its state and the unix time it was seen ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self._run(["scontrol", "show", "job", "-o", job.job_id]).splitlines()[0]
            state = re.search(r"JobState=(\S+)", text)
            if state and state[1] in SLURM_ENDED:
                return state[1], time.time()
            time.sleep(0.2)
        raise TimeoutError(f"Slurm job {job.job_id} still running after {timeout:.0f}s")

    def cancel(self, job: SlurmJob) -> None:
        subprocess.run(["scancel", "--full", "-s", "KILL", job.job_id], env=self.env, capture_output=True, timeout=30)

    def pids(self) -> list[int]:
        """The PIDs of the cluster's daemons and of its step daemons (slurmstepd: the jobs' processes below them)."""
        found = []
        for path in (self.lab / "run").glob("*.pid.ours"):
            try:
                found.append(int(path.read_text()))
            except (OSError, ValueError):
                continue
        return found + [p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "slurmstepd"]

    def stop(self) -> None:
        try:
            if self._running:
                self._script("stop", timeout=120)
                self._running = False
        finally:
            shutil.rmtree(self.lab, ignore_errors=True)

    def _script(self, command: str, timeout: float) -> str:
        return self._run(["bash", str(SLURM_SCRIPT), command], timeout=timeout)

    def _run(self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 30) -> str:
        done = subprocess.run(argv, env=env or self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done.stdout


def stop_process(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop a launcher started in a session of its own, and what it started: SIGTERM to its process group (the
    launcher stops its nodes), SIGKILL to the group after `grace` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    except ProcessLookupError:
        pass
