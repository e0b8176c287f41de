"""Preemption: SIGTERM (what Kubernetes sends before it evicts a pod) or a first Ctrl-C on a worker
node of a cluster with a checkpoint_dir writes a checkpoint at the next step boundary, then stops.

`paramserver node` installs the handlers (`install`) before it runs the script. The first signal
only sets a flag; the worker's next step (Context.on_step) sees it: the chief asks the coordinator
for a checkpoint, meets the others for it and, once it is written, raises `Preempted`; any other
worker leaves at its next step (the PS counted its data position, which the chief's checkpoint
holds). A resumed run (`--resume`) goes on from that checkpoint. In an elastic run a worker other
than the chief only leaves (`Left`): the others train on (docs/elastic.md).

Bounded: when the node has not stopped `grace` seconds after the signal, it says so and exits
without the checkpoint (the previous one stays the latest). A second signal stops the node at once
(KeyboardInterrupt, as without a checkpoint_dir).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

_requested: int | None = None  # the signal that asked for the preemption checkpoint, once one did
_grace_s = 0.0
_installed = False  # install() ran: a worker's steps look for a request (worker/context.py)
_leaves = False  # an elastic run's worker: the signal asks it to leave, not to checkpoint


class Preempted(KeyboardInterrupt):
    """Raised at a step boundary once a preempted worker is done (after the chief's checkpoint):
    a KeyboardInterrupt, so that a script's `except Exception` does not swallow it."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")
        self.signum, self.step = signum, step

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Left(Preempted):
    """Raised at a step boundary by a worker of an elastic run that was asked to go (SIGTERM: a
    scale-down, or its pod or node going away) once it left: its data split went back to the
    coordinator and nothing waits for it. Nothing failed: the node exits with 0."""

    @property
    def exit_code(self) -> int:
        return 0


def install(grace_s: float, leaves: bool = False) -> None:
    """Turn the first SIGTERM or SIGINT of this process into a preemption request (from the main thread);
    `leaves`: an elastic run's worker other than the chief, which then leaves the run instead."""
    global _grace_s, _installed, _leaves
    _grace_s, _installed, _leaves = grace_s, True, leaves
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _on_signal)


def installed() -> bool:
    """Whether `install` ran in this process: before that no signal asks for a preemption, and a
    worker's steps do not look for one."""
    return _installed


def requested() -> int | None:
    """The signal that asked this worker to checkpoint and stop, or None."""
    return _requested


def _on_signal(signum: int, frame: object) -> None:
    global _requested
    if _requested is not None:  # the second signal: stop at once
        raise KeyboardInterrupt
    _requested = signum
    log.warning(
        "%s: %s at the next step, then stopping (within %.0fs; a second signal stops at once)",
        signal.Signals(signum).name,
        "leaving the run" if _leaves else "writing a checkpoint",
        _grace_s,
        extra={"event": "preemption"},
    )
    watchdog = threading.Timer(_grace_s, _give_up, args=(signum,))
    watchdog.daemon = True
    watchdog.start()


def _give_up(signum: int) -> None:
    """The grace is over and the node still runs: say so and exit without the checkpoint."""
    log.error(
        "the preemption checkpoint did not finish within %.0fs of %s; exiting without it "
        "(the latest complete checkpoint stays the one to resume from)",
        _grace_s,
        signal.Signals(signum).name,
        extra={"event": "preemption_timeout"},
    )
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(128 + signum)


def reset() -> None:
    """Forget a request (tests)."""
    global _requested
    _requested = None
