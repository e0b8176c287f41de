"""Slurm, for real: the sbatch script `paramserver slurm` writes (launch/slurm/sbatch.py), submitted to a
two-node cluster (tests/engines/conftest.py), runs the nodes with `srun paramserver node`, each taking its
role from the job's environment: the CTR example trains and finishes at the held-out AUC of `paramserver
run`; `scancel --signal=TERM` (every task, the PS too) gives a checkpoint from which the requeued job
resumes at the same data position; a lost node requeues the job, which resumes from a checkpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from paramserver.checkpoint.store import CheckpointStore
from paramserver.launch.slurm.sbatch import BatchJob, render

pytestmark = pytest.mark.engines

ROOT = Path(__file__).resolve().parents[2]
COUNT = str(Path(__file__).resolve().parent / "scripts" / "count.py")
CTR = str(ROOT / "examples" / "ctr.py")
STARTS = re.compile(r"^worker (\d+) on (\S+) starts at position (\d+)$", re.M)
TRAINED = re.compile(r"^worker (\d+) on (\S+) trained to position (\d+)$", re.M)


def _submit(cluster, tmp_name: str, script: str, args: tuple[str, ...], **options) -> tuple[str, Path]:
    folder = cluster.lab / tmp_name
    folder.mkdir(exist_ok=True)
    job = BatchJob(
        script=script,
        args=args,
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


def _count(cluster, tmp_name: str, batches: int, step_sleep: float, **options) -> tuple[str, Path]:
    args = ("--batches", str(batches), "--step-sleep", str(step_sleep), "--record", str(cluster.lab / tmp_name))
    (cluster.lab / tmp_name).mkdir()
    return _submit(cluster, tmp_name, COUNT, args, **options)


def _output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="module")
def ctr_data(slurm_cluster) -> tuple[str, ...]:
    """Small Criteo-format files (examples/ctr_data.py) on the storage every node shares, and the CTR example's args."""
    folder = slurm_cluster.lab / "ctr-data"
    folder.mkdir()
    make = [sys.executable, str(ROOT / "examples" / "ctr_data.py"), "--vocab", "50000"]
    for name, rows, seed in (("train", 12_000, 1), ("test", 3_000, 2)):
        where = str(folder / f"{name}.tsv")
        subprocess.run([*make, "--rows", str(rows), "--seed", str(seed), "--out", where], check=True, timeout=120)
    train, test = str(folder / "train.tsv"), str(folder / "test.tsv")
    return ("--train", train, "--test", test, "--batch-size", "128", "--table-rows", "100000")


def test_the_ctr_example_trains_on_both_nodes_to_the_auc_of_paramserver_run(slurm_cluster, ctr_data, tmp_path):
    # sync steps: both runs take the same steps on the same data, so their AUCs agree closely
    job, out = _submit(slurm_cluster, "ctr", CTR, ctr_data, mode="sync")
    run = [sys.executable, "-m", "paramserver", "run", "--ps", "1", "--workers", "2", "--mode", "sync"]
    run += ["--checkpoint-dir", str(tmp_path / "ckpt"), CTR, "--", *ctr_data]
    # the reference, meanwhile: the same script and data under `paramserver run`
    local = subprocess.Popen(run, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=slurm_cluster.env)
    try:
        fields = slurm_cluster.wait(job, timeout=120)
        reference = json.loads(local.communicate(timeout=120)[0].strip().splitlines()[-1])
    finally:
        local.kill()
    text = _output(out)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text
    assert re.search(r"^PARAMSERVER_READY ps 0 ", text, re.M), text
    # three tasks over two nodes, in blocks: the PS and the chief on the first, the other worker on the second
    ranks = re.findall(r"Slurm rank \d+ of 3 on (\S+): (\w+ \d+) at", text)
    assert sorted(ranks) == [("pse1", "chief 0"), ("pse1", "ps 0"), ("pse2", "worker 0")], text
    steps = {int(w): int(n) for w, n in re.findall(r"worker (\d) finished its data after (\d+) steps", text)}
    assert steps == {0: 47, 1: 47}, text  # 6,000 lines each, 128 a batch
    auc = float(re.search(r"^held-out AUC (\d\.\d+)$", text, re.M)[1])
    print(f"held-out AUC: {auc:.4f} under Slurm, {reference['test_auc']:.4f} under paramserver run")
    assert auc > 0.6, text  # learned: a model that learned nothing scores 0.5
    assert abs(auc - reference["test_auc"]) <= 0.01, (auc, reference)


def _recorded(folder: Path, worker: int) -> list[list[int]]:
    """The batches `worker` trained, one list per start of the script (count.py's --record)."""
    runs: list[list[int]] = []
    for line in (folder / f"worker-{worker}.txt").read_text().splitlines():
        if line.startswith("start "):
            runs.append([])
        else:
            runs[-1].append(int(line))
    return runs


def test_scancel_term_writes_a_checkpoint_and_the_requeued_job_resumes_at_the_same_data_position(slurm_cluster):
    folder = slurm_cluster.lab / "requeue"
    job, out = _count(slurm_cluster, "requeue", batches=200, step_sleep=0.03, preempt_grace_s=6)
    slurm_cluster.wait(job, 60, until=lambda f: re.search(r"worker 0 on \S+ at position ([4-9]\d|\d{3})", _output(out)))
    slurm_cluster.run("scancel", "--signal=TERM", job)  # every task of the job's step: the PS as well
    fields = _ended_after_a_requeue(slurm_cluster, job)
    text = _output(out)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text
    assert fields["Restarts"] == "1", text
    assert "nodes exited with 143" in text, text  # the step stopped by the TERM: the batch shell requeued it
    step = int(re.search(r"preemption checkpoint written after step (\d+)", text)[1])
    assert f"ckpt-{step:09d}" in CheckpointStore(str(folder / "ckpt")).complete(), text
    starts = {int(w): int(p) for w, _, p in STARTS.findall(text)[2:]}
    assert starts[0] == step, text  # the chief resumes right after the checkpoint's step
    for worker in (0, 1):
        before, again = _recorded(folder, worker)
        print(f"worker {worker}: trained batches 0-{before[-1]}, then, requeued, {again[0]}-{again[-1]}")
        assert before == list(range(len(before))) and again == list(range(starts[worker], 200)), text
        # nothing lost; repeated at most the step this worker had in flight when the checkpoint was cut
        assert starts[worker] <= len(before) <= starts[worker] + 1, (worker, len(before), starts, text)
    assert {int(w): int(p) for w, _, p in TRAINED.findall(text)} == {0: 200, 1: 200}, text


def test_a_lost_node_requeues_the_job_which_resumes_from_the_latest_checkpoint(slurm_cluster):
    job, out = _count(slurm_cluster, "lost", batches=200, step_sleep=0.03, checkpoint_every=20)
    slurm_cluster.wait(job, 60, until=lambda f: re.search(r"worker 0 on \S+ at position ([6-9]\d|\d{3})", _output(out)))
    slurm_cluster.script("kill-node", "pse2")  # its slurmd, the job's slurmstepd and worker 1
    # what slurmctld decides by itself once the node stops answering (about 25 s here), at once
    slurm_cluster.run("scontrol", "update", "nodename=pse2", "state=down", "reason=lost")
    slurm_cluster.script("restart-node", "pse2")
    fields = _ended_after_a_requeue(slurm_cluster, job)
    text = _output(out)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", text
    starts = [(int(w), int(p)) for w, _, p in STARTS.findall(text)]
    assert sorted(starts[:2]) == [(0, 0), (1, 0)], text
    resumed = dict(starts[2:])
    assert resumed.keys() == {0, 1} and resumed[0] >= 20, text  # from a periodic checkpoint, not from 0
    assert {int(w): int(p) for w, _, p in TRAINED.findall(text)} == {0: 200, 1: 200}, text


def _ended_after_a_requeue(cluster, job: str) -> dict[str, str]:
    """The job's fields once its run after a requeue ended (90 s at most)."""
    return cluster.wait(
        job,
        timeout=90,
        until=lambda f: f["JobState"] in {"COMPLETED", "FAILED", "CANCELLED"} and int(f.get("Restarts", "0")) >= 1,
    )
