"""How many torch threads a worker gets, and how its OpenMP threads wait (docs/performance.md,
"Torch threads of a worker").

torch's intra-op threads are OpenMP threads (libgomp in the CPU wheels; MKL runs on the same
runtime). Between parallel regions they spin for a while before they sleep, and a worker waits
for its PS's reply between every two steps: spinning threads then take the cores the PS and
any other process need. On a shared 2-core machine with two busy processes a 1 PS x 1 worker
run fell from ~5,000 to ~400-900 examples/s that way. Two things prevent it:

- the processes `paramserver run` starts get a passive wait policy (their threads sleep as
  soon as a parallel region ends) unless the user's environment already chose one (importing
  paramserver sets it in its own process too: base/omp_wait.py);
- a worker gets the cores that are idle when the run starts, shared out among the workers (at
  least one thread): the PS works mostly while its workers wait for its replies, so it needs no
  core of its own, but cores that other processes keep busy are not counted. A script run with
  no cluster (in-process shards) is such a run's single worker (`lone_worker_threads`).

The choice is made here, from numbers passed in, and the launcher puts it into each child's
environment and options (join.py into an in-process cluster's): nothing deeper reads the
environment for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

from paramserver.base.omp_wait import PASSIVE_WAIT_ENV, wait_policy_env

__all__ = [
    "PASSIVE_WAIT_ENV",
    "ThreadChoice",
    "choose",
    "choose_torch_threads",
    "lone_worker_threads",
    "measure",
    "wait_policy_env",
]

_SAMPLE_S = 0.1  # how long the launcher samples the machine's CPU use before it chooses


@dataclass(frozen=True)
class ThreadChoice:
    """What a worker of a local run gets: its torch intra-op threads, and the variables added to
    every child's environment (those the user's environment did not set already)."""

    torch_threads: int
    env: Mapping[str, str]


def choose_torch_threads(cores: int, num_workers: int, busy_cores: float) -> int:
    """Torch threads per worker: the idle cores (`cores` less the `busy_cores` other processes use,
    rounded to whole cores) shared out among the workers, at least 1."""
    if num_workers < 1:
        raise ValueError(f"need at least 1 worker, got {num_workers}")
    idle = round(max(0.0, cores - max(0.0, busy_cores)))
    return max(1, idle // num_workers)


def choose(num_workers: int, cores: int, busy_cores: float, environ: Mapping[str, str]) -> ThreadChoice:
    """The whole choice, from the machine's numbers (`measure` reads them)."""
    return ThreadChoice(choose_torch_threads(cores, num_workers, busy_cores), wait_policy_env(environ))


def usable_cores() -> list[int]:
    """The cores this process may run on (its CPU affinity: a container's or `taskset`'s cores)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform: every core
        return list(range(os.cpu_count() or 1))


def busy_cores_now(cores: list[int], sample_s: float = _SAMPLE_S) -> float:
    """How many of `cores` the machine's processes keep busy, sampled over `sample_s` seconds."""
    percent = psutil.cpu_percent(interval=sample_s, percpu=True)
    return sum(percent[c] for c in cores if c < len(percent)) / 100.0


def measure(num_workers: int) -> ThreadChoice:
    """`choose` for this process now: its usable cores, their use over a short sample, this environment."""
    cores = usable_cores()
    return choose(num_workers, len(cores), busy_cores_now(cores), os.environ)


def lone_worker_threads(environ: Mapping[str, str]) -> int:
    """Torch threads for a script that runs its shards in-process (no cluster): `measure(1)`'s
    choice, or 0 (torch's default stands) when `environ` sets OMP_NUM_THREADS (the user's choice)."""
    if environ.get("OMP_NUM_THREADS"):
        return 0
    return measure(1).torch_threads
