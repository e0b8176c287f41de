"""A real Slurm cluster for the engine tests: munged, slurmctld and two slurmd "hosts", each in a network
namespace with its own name and address (tests/engines/slurm_cluster.sh, netns mode), started once per
session and stopped (every daemon by its PID, the namespaces removed) at its end.

Needs root (namespaces, the daemons) and Slurm's Debian packages, which the fixture installs with apt
(`slurm_cluster.sh install`); without either, the tests are skipped saying why. The cluster's names,
addresses and ports (nodes pse1, pse2 on 10.78.0.0/24, slurmctld on 17817) keep clear of another
cluster of the same script on its defaults."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "slurm_cluster.sh"
NODES = ("pse1", "pse2")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@dataclass
class SlurmCluster:
    """The running cluster: `env` for its clients (sbatch, scancel, ...), `lab` its folder."""

    lab: Path
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = 30) -> str:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stdout}{done.stderr}")
        return done.stdout

    def script(self, *argv: str, timeout: float = 90) -> str:
        return self.run("bash", str(SCRIPT), *argv, timeout=timeout)

    def sbatch(self, path: Path) -> str:
        return self.run("sbatch", "--parsable", str(path)).strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """`scontrol show job`'s fields of the job (of its first component)."""
        text = self.run("scontrol", "show", "job", "-o", job).splitlines()[0]
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job: str, timeout: float, until=lambda fields: fields["JobState"] in ENDED) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job)
            if until(fields):
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job} still {fields['JobState']} after {timeout:.0f}s: {fields}")
            time.sleep(0.5)


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm cluster needs root (network namespaces, slurmd); not root"
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        return "Slurm is not installed and there is no apt-get to install slurm-wlm and munge"
    return None


@pytest.fixture(scope="session")
def slurm_cluster():
    why = _skip_reason()
    if why:
        pytest.skip(why)
    lab = Path(tempfile.mkdtemp(prefix="ps-slurm-"))
    lab.chmod(0o755)  # the daemons run as root, but the munge socket's folder must be reachable
    env = {
        **os.environ,
        "SLURM_LAB": str(lab),
        "SLURM_LAB_MODE": "netns",
        "SLURM_LAB_NAME": "pse",
        "SLURM_LAB_NET": "10.78.0",
        "SLURM_LAB_PORT": "17817",
        "SLURM_LAB_CRED_EXPIRE": "5",  # a requeued job starts again about 6 s later
        "SLURM_CONF": str(lab / "etc" / "slurm.conf"),
    }
    for key in ("TF_CONFIG", "PARAMSERVER_OPTIONS", "PARAMSERVER_CLUSTER"):
        env.pop(key, None)
    cluster = SlurmCluster(lab, env)
    try:
        cluster.script("install", timeout=600)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        shutil.rmtree(lab, ignore_errors=True)
        pytest.skip(f"apt could not install slurm-wlm and munge: {exc}")
    try:
        cluster.script("start")
        yield cluster
    finally:
        try:
            cluster.script("stop")
        finally:
            shutil.rmtree(lab, ignore_errors=True)
