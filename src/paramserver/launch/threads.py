"""How many torch threads a worker gets, and how its OpenMP threads wait (docs/performance.md,
"Torch threads of a worker").

torch's intra-op threads are OpenMP threads (libgomp in the CPU wheels; MKL runs on the same
runtime). Between parallel regions they spin for a while before they sleep, and a worker waits
for its PS's reply between every two steps: spinning threads then take the cores the PS and
any other process need. On a shared 2-core machine with two busy processes a 1 PS x 1 worker
run fell from ~5,000 to ~400-900 examples/s that way. Two things prevent it:

- the processes `paramserver run` starts get a passive wait policy (their threads sleep as
  soon as a parallel region ends) unless the user's environment already chose one;
- a worker gets the cores that are idle when the run starts, shared out among the workers (at
  least one thread): the PS works mostly while its workers wait for its replies, so it needs no
  core of its own, but cores that other processes keep busy are not counted.

The choice is made here, from numbers passed in, and the launcher puts it into each child's
environment and options: nothing deeper reads the environment for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

# Each variable is a runtime's own knob for the same thing: libgomp reads OMP_WAIT_POLICY (and
# GOMP_SPINCOUNT), Intel's OpenMP KMP_BLOCKTIME (milliseconds a thread spins before it sleeps).
PASSIVE_WAIT_ENV: Mapping[str, str] = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0"}
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


def wait_policy_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that make OpenMP threads sleep when idle, to add to a child's environment;
    none when `environ` already sets one of them (the user's choice stands)."""
    if any(name in environ for name in PASSIVE_WAIT_ENV):
        return {}
    return dict(PASSIVE_WAIT_ENV)


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
