"""An elastic run on Ray (`max_workers` M > 0, docs/elastic.md): M worker slots, `num_workers` of them started,
and `paramserver scale [RUN] N` followed while the run trains, as under `paramserver run`.

The driver writes a run file in this host's runs directory (launch/local/run_files.py) naming the run's
cluster and M; `paramserver scale` on the driver's host writes its wish next to it (launch/local/elastic.py).
For more workers the engine starts the lowest free slots, each in a new actor that Ray places on whichever
node has room (a node that joined the Ray cluster since the start included); for fewer it asks the
highest-numbered workers but the chief to leave (SIGTERM to their node process: they finish their step and
hand their data back). A worker killed, or lost with its Ray node, with no restart left is a leave, not a
failure. Not thread-safe: the engine's driving thread (RayCluster.wait) calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from paramserver.base.errors import ConfigError
from paramserver.launch.local import elastic
from paramserver.launch.local.processes import LineWriter
from paramserver.launch.local.run_files import LauncherFiles

log = logging.getLogger(__name__)


class Slot(Protocol):
    """A worker of the run as the scaling sees it (the engine's node)."""

    label: str
    index: int

    def poll(self) -> int | None: ...  # None while it runs; its exit code (negative: a signal) once it ended

    def terminate(self) -> None: ...  # ask it to leave


class Scaling:
    """The slots of an elastic Ray run, its scale wishes and its run file (see the module docstring)."""

    def __init__(self, max_workers: int, wanted: int, lines: LineWriter) -> None:
        self.slots = elastic.WorkerSet(max_workers, wanted)
        self._lines = lines
        self._files: LauncherFiles | None = None

    @property
    def max_workers(self) -> int:
        return self.slots.max_workers

    def publish(self, cluster: dict[str, list[str]]) -> None:
        """Write (again, after a roll-back) the run file `paramserver scale` finds; said once. A runs directory
        refused or unwritable costs the run its scaling, not its start."""
        first = self._files is None
        try:
            self._files = self._files or LauncherFiles.create()
            path = self._files.write(cluster, self.max_workers)
        except (ConfigError, OSError) as exc:
            self._lines.write("run", f"no run file: {exc}; `paramserver scale` cannot reach this run")
            return
        self.slots.wish_path = elastic.scale_path(path)
        if first:
            self._lines.write("run", f"cluster file: {path} (`paramserver scale {Path(path).stem} N` resizes the run)")

    def remove(self) -> None:
        """Delete the run file and any wish (the run ended). Idempotent."""
        if self._files is not None:
            self._files.remove()

    def follow(self, workers: list[Any], start: Callable[[int], Any]) -> list[int]:
        """Start or ask to leave workers as a new scale wish asks (`workers`: the nodes by slot, changed in place;
        `start(slot)`: a new worker in `slot`); returns the slots started."""
        return [slot for slot, _ in self.slots.follow_wish(workers, start, self._lines)]

    def left(self, node: Slot, how: str, restart_left: bool) -> bool:
        """Whether worker `node`, ended (`how`: in words), left the run rather than finished or failed: it was
        asked to, or it was killed (or lost) with no restart left. Never the chief."""
        if node.index == 0:
            return False
        code = node.poll()
        killed = code is not None and code < 0
        return self.slots.left(node.index, node.label, how, killed, restart_left, self._lines)

    def running(self, workers: list[Any]) -> int:
        return sum(node.poll() is None for node in workers)

    def record(self) -> dict[str, Any]:
        """The closing line's fields: the slots and the joins and leaves."""
        return {"max_workers": self.max_workers, "membership": self.slots.events}
