"""`python -m paramserver.launch.slurm.preempt`: SIGTERM the workers of a Slurm job step on this node,
then wait until they exited.

Run by the sbatch script of `paramserver slurm` (launch/slurm/sbatch.py), one task per node, when the job
is told to stop (Slurm's warning before the time limit, `scancel --batch --signal=TERM`). Slurm can only
signal whole steps, whose PS would drain at once; so this finds the workers' processes by their task
environment: SLURM_JOB_ID and SLURM_STEP_ID of the nodes' step, SLURM_PROCID at or past the first
worker's rank, SLURMD_NODENAME this node's (nodes that share a PID namespace see each other's tasks, and
a second TERM would stop a worker at once), and a parent outside the task (a task's own children are
its business). Each writes
its preemption checkpoint (the chief) or leaves at its next step (worker/recovery/preemption.py).

Exits 0 once no such worker runs here, 1 when some still run after --wait seconds. Not thread-safe:
a command-line tool.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import psutil

log = logging.getLogger(__name__)


def worker_tasks(job: str, step: str, first_worker: int, node: str | None) -> list[psutil.Process]:
    """The processes on `node` (None: any) that are worker tasks (their top process) of step `job`.`step`."""
    found = {}
    for proc in psutil.process_iter():
        rank = _worker_rank(proc, job, step, first_worker, node)
        if rank is not None:
            found[proc.pid] = proc
    return [proc for proc in found.values() if _parent_pid(proc) not in found]


def _worker_rank(proc: psutil.Process, job: str, step: str, first_worker: int, node: str | None) -> int | None:
    try:
        env = proc.environ()
    except (psutil.Error, OSError):  # gone, or not ours to read
        return None
    if env.get("SLURM_JOB_ID") != job or env.get("SLURM_STEP_ID", env.get("SLURM_STEPID")) != step:
        return None
    if node is not None and env.get("SLURMD_NODENAME") != node:
        return None
    try:
        rank = int(env.get("SLURM_PROCID", ""))
    except ValueError:
        return None
    return rank if rank >= first_worker else None


def _parent_pid(proc: psutil.Process) -> int | None:
    try:
        return proc.ppid()
    except psutil.Error:
        return None


def preempt(job: str, step: str, first_worker: int, wait_s: float, node: str | None) -> bool:
    """TERM the step's workers on `node` and wait up to `wait_s` for them to exit; True if they did."""
    workers = worker_tasks(job, step, first_worker, node)
    for proc in workers:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            continue
    log.info(
        "SIGTERM sent to %d worker(s) of step %s.%s on %s: pids %s",
        len(workers),
        job,
        step,
        node or "this host",
        [p.pid for p in workers],
    )
    deadline = time.monotonic() + wait_s
    while workers and time.monotonic() < deadline:
        workers = [proc for proc in workers if _running(proc)]
        time.sleep(0.2)
    if workers:
        log.error("%d worker(s) still run %.0fs after SIGTERM: %s", len(workers), wait_s, [p.pid for p in workers])
    return not workers


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="SIGTERM a Slurm step's workers on this node, wait for them")
    parser.add_argument("--job", required=True, help="the job id (SLURM_JOB_ID)")
    parser.add_argument("--step", default="0", help="the nodes' step id (default 0)")
    parser.add_argument("--first-worker", type=int, required=True, help="rank of the chief: the number of PS")
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for them to exit (default 60)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s preempt %(levelname)s %(message)s")
    node = os.environ.get("SLURMD_NODENAME")  # this task's node: srun sets it
    return 0 if preempt(args.job, args.step, args.first_worker, args.wait, node) else 1


if __name__ == "__main__":
    sys.exit(main())
