"""An elastic run's workers as `paramserver run` keeps them: how many are wanted, which slots run,
and the joins and leaves with their times (docs/elastic.md).

`paramserver scale [RUN] N` writes the wish next to the run's file, `run-<pid>-<tag>.scale` (JSON
`{"workers": N}`, mode 0600, in the runs directory that only its user may write). The launcher reads
it about once a second: for more workers it starts the lowest free slots; for fewer it sends
SIGTERM to the highest-numbered workers (never worker 0, the chief), which leave at their next
step boundary and hand their data back to the coordinator. A wish it cannot follow (not a number,
below 1, above `max_workers`) is said on the launcher's output and left unapplied.

Not thread-safe: the launcher's main thread (LocalCluster.wait) calls it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paramserver.base.errors import ConfigError
from paramserver.launch.local.processes import LineWriter

log = logging.getLogger(__name__)
_MAX_WISH_BYTES = 4096  # {"workers": N} is far less


def scale_path(run_path: Path) -> Path:
    """Where the scale wish of the run whose file is `run_path` lies."""
    return run_path.with_suffix(".scale")


def read_wish(path: Path, max_workers: int) -> int:
    """The worker count asked for in `path` (ConfigError naming what is wrong)."""
    with path.open("rb") as stream:
        text = stream.read(_MAX_WISH_BYTES + 1)
    if len(text) > _MAX_WISH_BYTES:
        raise ConfigError(f'{path}: larger than {_MAX_WISH_BYTES} bytes; it holds {{"workers": N}}')
    try:
        workers = json.loads(text)["workers"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f'{path}: not {{"workers": N}}: {exc!r}') from None
    check_count(workers, max_workers)
    return workers


def check_count(workers: object, max_workers: int) -> None:
    """Refuse a worker count an elastic run of `max_workers` slots cannot take."""
    if type(workers) is not int or not 1 <= workers <= max_workers:
        raise ConfigError(f"the workers wanted must be a whole number from 1 to {max_workers}, got {workers!r}")


@dataclass
class WorkerSet:
    """The wanted worker count of an elastic run, the scale wish it follows, and its membership events."""

    max_workers: int
    wanted: int
    started_at: float = field(default_factory=time.monotonic)
    wish_path: Path | None = None  # set once the run has a run file
    events: list[dict] = field(default_factory=list)
    leaving: set[int] = field(default_factory=set)  # slots asked to leave (SIGTERM), not yet seen to go
    short: int = 0  # workers wanted that found no free slot yet (their slots still leave)
    _wish_mtime: tuple[int, int] = (0, 0)

    def new_wish(self) -> int | None:
        """The worker count a scale wish written since the last call asks for, or None (no new wish,
        or one refused: ConfigError, which the caller says)."""
        if self.wish_path is None:
            return None
        try:
            stat = self.wish_path.stat()
            mtime = (stat.st_ino, stat.st_mtime_ns)  # each wish is a new file: two in one clock tick differ
        except FileNotFoundError:
            return None
        if mtime == self._wish_mtime:
            return None
        self._wish_mtime = mtime
        wanted = read_wish(self.wish_path, self.max_workers)
        if wanted == self.wanted:
            return None
        self.wanted = wanted
        return wanted

    def record(self, worker: int, event: str) -> None:
        """A worker started, left, died or was asked to leave: kept with the seconds since the run began."""
        self.events.append({"t": round(time.monotonic() - self.started_at, 2), "worker": worker, "event": event})

    def follow_wish(self, workers: list[Any], start: Callable[[int], Any], lines: LineWriter) -> list[tuple[int, Any]]:
        """Start or ask to leave workers as a new scale wish asks (`workers`: the launcher's nodes by slot,
        changed in place; `start(slot)`: a new worker in `slot`), saying so on `lines`; returns the
        (slot, node) started. A wish not followed in full (its slots still left) is followed again
        until it is."""
        try:
            fresh = self.new_wish() is not None
        except (ConfigError, OSError) as exc:
            lines.write("run", f"scale wish refused: {exc}")
            return []
        if not fresh and not self.short:
            return []
        done = follow(workers, self.wanted, self.leaving, start, self.max_workers)
        self.short = done.short
        if not (fresh or done.started or done.stopping):
            return []
        for slot in done.stopping:
            self.record(slot, "asked to leave")
        waiting = f"; {done.short} wait for slots still leaving" if done.short else ""
        lines.write(
            "run",
            f"scaling to {self.wanted} workers: started {[slot for slot, _ in done.started]}, "
            f"asked to leave {done.stopping}{waiting}",
            event="scale",
        )
        return done.started

    def left(self, slot: int, label: str, how: str, killed: bool, restart_left: bool, lines: LineWriter) -> bool:
        """Whether the worker of `slot` (not the chief), ended (`how`: in words), left the run rather
        than finished or failed: it was asked to, or it was `killed` (a signal, or its host lost) with
        no restart left. Said on `lines` and recorded."""
        if slot in self.leaving:
            self.leaving.discard(slot)
            self.record(slot, "left")
            lines.write("run", f"{label} left the run ({how})", event="left")
            return True
        if killed and not restart_left:
            self.record(slot, "died")
            lines.write("run", f"{label} {how}; no restart left: the others go on", event="left")
            return True
        return False


def write_wish(run_path: Path, workers: int) -> Path:
    """Ask the launcher of the run whose file is `run_path` for `workers` workers; returns the wish's path.
    Replaced atomically, private to this user (launch/local/run_files.py checked the folder)."""
    path = scale_path(run_path)
    partial = path.with_suffix(".scale-tmp")
    partial.unlink(missing_ok=True)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"workers": workers}, out)
    partial.replace(path)
    return path


@dataclass
class Rescale:
    """What following a new wish did: the workers started (slot, child) and the slots asked to leave."""

    started: list[tuple[int, Any]] = field(default_factory=list)
    stopping: list[int] = field(default_factory=list)
    short: int = 0  # workers not started for want of a free slot (slots whose workers still leave)


def follow(
    workers: list[Any], wanted: int, leaving: set[int], start: Callable[[int], Any], max_workers: int
) -> Rescale:
    """Match `wanted`: start the lowest free slots below `max_workers` (`start(slot)` gives the child,
    put into `workers` at its slot), or SIGTERM the highest-numbered running workers but the chief,
    adding them to `leaving`. `workers` is the launcher's list by slot; a slot is free once its child
    exited and, if it was asked to leave, the launcher saw it go (it is no longer in `leaving`): the
    workers that found no free slot are `short`, for a later call."""
    done = Rescale()
    running = [i for i, child in enumerate(workers) if child.poll() is None and i not in leaving]
    for slot in sorted(running, reverse=True)[: max(0, len(running) - wanted)]:
        if slot == 0:
            break
        workers[slot].terminate()
        leaving.add(slot)
        done.stopping.append(slot)
    free = [
        i for i in range(1, max_workers) if i not in leaving and (i >= len(workers) or workers[i].poll() is not None)
    ]
    missing = max(0, wanted - len(running))
    done.short = max(0, missing - len(free))
    for slot in free[:missing]:
        child = start(slot)
        if slot < len(workers):
            workers[slot] = child
        else:
            workers.append(child)
        leaving.discard(slot)
        done.started.append((slot, child))
    return done
