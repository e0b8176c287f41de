"""Slurm, for real: the sbatch script `paramserver slurm` writes (launch/slurm/sbatch.py), submitted to a
two-node cluster (tests/engines/conftest.py), runs the nodes with `srun paramserver node`, each taking its
role from the job's environment; it trains and finishes, and Slurm's TERM gives a checkpoint from which
the requeued job resumes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from paramserver.launch.slurm.sbatch import BatchJob, render

pytestmark = pytest.mark.engines

COUNT = str(Path(__file__).resolve().parent / "scripts" / "count.py")
STARTS = re.compile(r"^worker (\d+) on (\S+) starts at position (\d+)$", re.M)
TRAINED = re.compile(r"^worker (\d+) on (\S+) trained to position (\d+)$", re.M)


def _submit(cluster, tmp_name: str, batches: int, step_sleep: float, **options) -> tuple[str, Path]:
    folder = cluster.lab / tmp_name
    folder.mkdir()
    job = BatchJob(
        script=COUNT,
        args=("--batches", str(batches), "--step-sleep", str(step_sleep)),
        ps=1,
        workers=2,
        nodes=2,
        grace=60,
        name=tmp_name,
        python=sys.executable,
        output=str(folder / "out-%j.txt"),
        options={"checkpoint_dir": str(folder / "ckpt"), **options},
    )
    path = folder / "job.sh"
    path.write_text(render(job))
    job_id = cluster.sbatch(path)
    return job_id, folder / f"out-{job_id}.txt"


def _output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def test_an_sbatch_job_trains_on_both_nodes_and_finishes(slurm_cluster):
    job, out = _submit(slurm_cluster, "trains", batches=60, step_sleep=0.0)
    fields = slurm_cluster.wait(job, timeout=90)
    text = _output(out)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text
    trained = {int(w): (host, int(p)) for w, host, p in TRAINED.findall(text)}
    assert trained == {0: (trained[0][0], 60), 1: (trained[1][0], 60)}, text
    assert re.search(r"^PARAMSERVER_READY ps 0 ", text, re.M), text
    # three tasks over two nodes, in blocks: the PS and the chief on the first, the other worker on the second
    assert {w: host for w, host, _ in STARTS.findall(text)} == {"0": "pse1", "1": "pse2"}, text


def test_a_term_writes_a_checkpoint_and_the_requeued_job_resumes_from_it(slurm_cluster):
    job, out = _submit(slurm_cluster, "requeue", batches=400, step_sleep=0.05)
    slurm_cluster.wait(job, 60, until=lambda f: re.search(r"worker 0 on \S+ at position ([4-9]\d|\d{3})", _output(out)))
    slurm_cluster.run("scancel", "--batch", "--signal=TERM", job)
    fields = slurm_cluster.wait(
        job,
        timeout=90,
        until=lambda f: f["JobState"] in {"COMPLETED", "FAILED", "CANCELLED"} and int(f.get("Restarts", "0")) >= 1,
    )
    text = _output(out)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text
    assert fields["Restarts"] == "1", text
    written = re.search(r"preemption checkpoint written after step (\d+)", text)
    assert written, text
    starts = [(int(w), int(p)) for w, _, p in STARTS.findall(text)]
    first, again = starts[:2], starts[2:]
    assert sorted(first) == [(0, 0), (1, 0)], text
    resumed = dict(again)
    assert resumed.keys() == {0, 1} and resumed[0] > 0, text  # the requeued job goes on, not from 0
    assert {int(w): int(p) for w, _, p in TRAINED.findall(text)} == {0: 400, 1: 400}, text


def test_a_lost_node_requeues_the_job_which_resumes_from_the_latest_checkpoint(slurm_cluster):
    job, out = _submit(slurm_cluster, "lost", batches=400, step_sleep=0.05, checkpoint_every=20)
    slurm_cluster.wait(job, 60, until=lambda f: re.search(r"worker 0 on \S+ at position ([6-9]\d|\d{3})", _output(out)))
    slurm_cluster.script("kill-node", "pse2")  # its slurmd, the job's slurmstepd and worker 1
    # what slurmctld decides by itself once the node stops answering (about 25 s here), at once
    slurm_cluster.run("scontrol", "update", "nodename=pse2", "state=down", "reason=lost")
    slurm_cluster.script("restart-node", "pse2")
    fields = slurm_cluster.wait(
        job,
        timeout=90,
        until=lambda f: f["JobState"] in {"COMPLETED", "FAILED", "CANCELLED"} and int(f.get("Restarts", "0")) >= 1,
    )
    text = _output(out)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text
    starts = [(int(w), int(p)) for w, _, p in STARTS.findall(text)]
    assert sorted(starts[:2]) == [(0, 0), (1, 0)], text
    resumed = dict(starts[2:])
    assert resumed.keys() == {0, 1} and resumed[0] >= 20, text  # from a periodic checkpoint, not from 0
    assert {int(w): int(p) for w, _, p in TRAINED.findall(text)} == {0: 400, 1: 400}, text
