"""`paramserver slurm`: a ready sbatch script that runs a cluster as one Slurm job (docs/deploy.md, "Slurm").

One job step, `srun python -m paramserver node SCRIPT ARGS`, starts every node; each task takes its role
from the job's environment (launch/slurm/environment.py): the first `ps` ranks are PS, the next the chief,
the rest workers. Two shapes: one homogeneous job (the default; the option `slurm_ps` tells the tasks how
many ranks are PS), or with `het` a heterogeneous job whose component 0 holds the PS (with `--mem`) and
component 1 the workers (with `--gres=gpu:G`, one worker per node, when GPUs are asked). The components
of a heterogeneous job never share a node, so it needs two nodes at least.

Preemption: every task of the nodes' step gets SIGTERM at once: from `scancel --signal=TERM JOBID`, or from
the batch shell, which `#SBATCH --signal=B:TERM@<grace>` warns before the time limit (and `scancel --batch
--signal=TERM`) and which passes it on to the step. The chief writes a checkpoint at its next step, the
other workers stop (worker/recovery/preemption.py); the PS serve on until then (a PS of a run that ends it,
with a checkpoint_dir, waits up to `preempt_grace_s` after its first TERM: node/ps_stop.py), and every
task exits 128 + SIGTERM. The batch shell requeues the job (`--requeue`) when it was warned or when the step
exited so. A requeued job (SLURM_RESTART_COUNT > 0) starts with `resume`: every node from the latest
complete checkpoint.

Pure text: nothing here runs Slurm. Thread-safe (immutable).
"""

from __future__ import annotations

import json
import re
import shlex
import signal
from dataclasses import dataclass, field

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$")  # Slurm's forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_MEMORY = re.compile(r"^\d+[KMGT]?$")
STEP = 0  # the nodes' step: the script's first srun
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # a node stopped by SIGTERM (a PS, or a worker after the checkpoint)


@dataclass(frozen=True)
class BatchJob:
    """What `paramserver slurm` was asked for. `options`: the options every node shares (flags);
    `checkpoint_dir` among them is required (shared storage: every PS writes its shard file there)."""

    script: str
    args: tuple[str, ...] = ()
    ps: int = 1
    workers: int = 1
    het: bool = False
    nodes: int = 0  # homogeneous: nodes to spread the tasks over (0: as Slurm packs them)
    gpus_per_worker: int = 0  # het only: one worker per node, with this many GPUs
    ps_mem: str = ""  # het only: memory of each PS node (--mem), e.g. 8G
    time: str = ""  # the job's time limit (Slurm's forms), "" the partition's default
    grace: int = 120  # seconds before the time limit at which the workers write a checkpoint
    partition: str = ""
    name: str = "paramserver"
    python: str = "python3"  # the interpreter with paramserver installed, on every node
    output: str = ""  # the job's output file (default <name>-%j.out), appended to by a requeued job
    port: int = 0  # base port of the nodes (option slurm_port); 0: derived from the job id
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = self._problems()
        if problems:
            raise ConfigError("; ".join(problems))
        Options.from_dict({**self.options, "stop_ps_at_end": True}).validate(self.workers)

    def _problems(self) -> list[str]:
        found = []
        if self.ps < 1 or self.workers < 1:
            found.append(f"--ps and --workers must be at least 1, got {self.ps} and {self.workers}")
        if not self.script:
            found.append("the training SCRIPT is missing")
        if not _NAME.match(self.name):
            found.append(f"--name {self.name!r} must be letters, digits, '_', '.' or '-'")
        if self.partition and not _NAME.match(self.partition):
            found.append(f"--partition {self.partition!r} must be letters, digits, '_', '.' or '-'")
        if self.time and not _TIME.match(self.time):
            found.append(f"--time {self.time!r} must be Slurm's MM, HH:MM:SS or D-HH:MM:SS")
        if self.ps_mem and not _MEMORY.match(self.ps_mem):
            found.append(f"--ps-mem {self.ps_mem!r} must be a number with an optional unit K, M, G or T, e.g. 8G")
        if self.gpus_per_worker < 0 or self.nodes < 0:
            found.append(
                f"--gpus-per-worker and --nodes must be 0 or more, got {self.gpus_per_worker} and {self.nodes}"
            )
        if not self.het and (self.gpus_per_worker or self.ps_mem):
            found.append("--gpus-per-worker and --ps-mem size the components of a heterogeneous job: give --het too")
        if self.het and self.nodes:
            found.append("--nodes spreads a homogeneous job: a heterogeneous job (--het) takes one node per component")
        if self.nodes > self.ps + self.workers:
            found.append(f"--nodes {self.nodes} is more than the {self.ps + self.workers} tasks (PS and workers)")
        if not 0 <= self.port <= 65000:
            found.append(f"--port must be from 1 to 65000 (0: derived from the job id), got {self.port}")
        preempt = float(self.options.get("preempt_grace_s", Options.preempt_grace_s))
        if self.grace <= preempt:
            found.append(
                f"--grace {self.grace} must be more than --preempt-grace {preempt:g}: the workers' checkpoint must "
                f"be written before Slurm's time limit kills the job"
            )
        directory = self.options.get("checkpoint_dir", "")
        if not directory:
            found.append("--checkpoint-dir is needed: the preemption checkpoint and a requeued job's resume go there")
        elif "://" not in directory and not directory.startswith("/"):
            found.append(
                f"--checkpoint-dir {directory!r} must be an absolute path on storage every node shares, or a URL "
                f"such as s3://bucket/run"
            )
        if not self.python or any(c.isspace() for c in self.python):
            found.append(f"--python {self.python!r} must be one interpreter path (no spaces)")
        return found

    def node_options(self, resume: bool) -> dict:
        """PARAMSERVER_OPTIONS of every node: the flags' options, the PS ended by the chief at the end
        (the step ends when every task did), the Slurm layout, and `resume` in a requeued job."""
        found: dict = {**self.options, "stop_ps_at_end": True}
        if not self.het:
            found["slurm_ps"] = self.ps
        if self.port:
            found["slurm_port"] = self.port
        if resume:
            found["resume"] = True
        return found


def render(job: BatchJob) -> str:
    """The sbatch script, ready for `sbatch`."""
    return "\n".join([*_header(job), "", *_body(job)]) + "\n"


def _header(job: BatchJob) -> list[str]:
    lines = [
        "#!/bin/bash",
        f"# written by `paramserver slurm`: {job.ps} PS and {job.workers} workers running {job.script}",
        f"#SBATCH --job-name={job.name}",
        f"#SBATCH --output={job.output or job.name + '-%j.out'}",
        "#SBATCH --open-mode=append",  # a requeued job appends to the same output
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:TERM@{job.grace}",
    ]
    if job.time:
        lines.append(f"#SBATCH --time={job.time}")
    if job.partition:
        lines.append(f"#SBATCH --partition={job.partition}")
    if not job.het:
        lines.append(f"#SBATCH --ntasks={job.ps + job.workers}")
        if job.nodes:
            lines.append(f"#SBATCH --nodes={job.nodes}")
        return lines
    lines += ["# component 0: the PS", f"#SBATCH --ntasks={job.ps}", "#SBATCH --nodes=1"]
    if job.ps_mem:
        lines.append(f"#SBATCH --mem={job.ps_mem}")
    lines += [
        "#SBATCH hetjob",
        "# component 1: the workers (the first is the chief)",
        f"#SBATCH --ntasks={job.workers}",
    ]
    if job.gpus_per_worker:
        lines += [f"#SBATCH --nodes={job.workers}", "#SBATCH --ntasks-per-node=1"]
        lines.append(f"#SBATCH --gres=gpu:{job.gpus_per_worker}")
    else:
        lines.append("#SBATCH --nodes=1")
    return lines


def _body(job: BatchJob) -> list[str]:
    q = shlex.quote
    node = " ".join(q(word) for word in (job.script, *job.args))
    group = "--het-group=0,1 " if job.het else ""
    return [
        "set -u",
        f"PYTHON={q(job.python)}",
        f"OPTIONS={q(json.dumps(job.node_options(False), sort_keys=True))}",
        f"RESUMING={q(json.dumps(job.node_options(True), sort_keys=True))}",
        "# a requeued job (preempted, a node lost) starts every node from the latest complete checkpoint",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then OPTIONS=$RESUMING; fi',
        "export PARAMSERVER_OPTIONS=$OPTIONS",
        'echo "paramserver: job $SLURM_JOB_ID start ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST"',
        "",
        "preempted=0",
        "preempt() {",
        "    # Slurm's warning (--signal) or `scancel --batch --signal=TERM`: passed on to every task of the",
        "    # step, as `scancel --signal=TERM JOBID` does; the chief writes a checkpoint at its next step, the",
        "    # PS serve until it is written; then the job is requeued",
        "    trap '' TERM",
        "    preempted=1",
        '    echo "paramserver: SIGTERM: a checkpoint at the workers\' next step, then a requeue"',
        f'    scancel --signal=TERM "$SLURM_JOB_ID.{STEP}" 2>/dev/null || true  # unless the step ended',
        "}",
        "trap preempt TERM",
        "",
        f'srun {group}--kill-on-bad-exit=0 "$PYTHON" -m paramserver node {node} &',
        "nodes=$!",
        'wait "$nodes"; code=$?',
        'while kill -0 "$nodes" 2>/dev/null; do wait "$nodes"; code=$?; done  # a trap returns wait early',
        'echo "paramserver: job $SLURM_JOB_ID nodes exited with $code"',
        f"# {PREEMPTED_EXIT_CODE} = 128 + SIGTERM: the step's tasks were told to stop (scancel --signal=TERM)",
        f'if [ "$preempted" = 1 ] || [ "$code" = {PREEMPTED_EXIT_CODE} ]; then',
        '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "fi",
        'exit "$code"',
    ]
