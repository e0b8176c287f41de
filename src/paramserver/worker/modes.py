"""Consistency-mode control from a worker: switching now, or on a schedule of steps."""

from __future__ import annotations

from dataclasses import dataclass

from ..base.consistency_spec import ConsistencySpec
from ..base.errors import ConfigError, ParamServerError


@dataclass(frozen=True)
class ModeChange:
    step: int
    mode: str


def parse_schedule(text: str) -> list[ModeChange]:
    """"sync@500" or "ssp:2@100,sync@900": switch to MODE when the chief reaches STEP."""
    changes = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        mode, at, step = entry.rpartition("@")
        if not at or not step.isdigit() or not mode:
            raise ConfigError(f"mode schedule entry {entry!r} is not MODE@STEP (e.g. sync@500)")
        changes.append(ModeChange(int(step), mode))
    if [c.step for c in changes] != sorted(c.step for c in changes):
        raise ConfigError(f"mode schedule {text!r} must list steps in increasing order")
    return changes


class ModeSwitcher:
    """Switches the cluster's mode through a PSClient; only the chief may. Not thread-safe."""

    def __init__(self, client, worker_index: int, num_workers: int, schedule: str = "",
                 backup_workers: int = 0, barrier=None) -> None:
        self.client = client
        self.barrier = barrier  # barrier(name, timeout): every worker meets there around a scheduled switch
        self.worker_index = worker_index
        self.num_workers = num_workers
        self.backup_workers = backup_workers
        self.pending = parse_schedule(schedule)
        for change in self.pending:  # refuse a bad mode now, not hours into training
            ConsistencySpec.parse(change.mode, max(num_workers, 1), 0)

    def set_mode(self, mode: str, backup_workers: int | None = None) -> ConsistencySpec:
        if self.worker_index != 0:
            raise ParamServerError(f"only the chief (worker 0) switches modes; this is worker {self.worker_index}")
        backups = self.backup_workers if backup_workers is None else backup_workers
        spec = ConsistencySpec.parse(mode, self.num_workers, backups if mode.startswith("sync") else 0)
        self.client.set_mode(spec)
        return spec

    def due(self, step: int) -> bool:
        return bool(self.pending) and self.pending[0].step <= step

    def on_step(self, step: int, timeout: float = 300.0) -> None:
        """Apply the scheduled changes due at `step` (each worker's own step count).

        Every worker stops at a barrier, the chief switches the shards while no push is in flight,
        and a second barrier lets everyone go on under the new mode.
        """
        while self.pending and self.pending[0].step <= step:
            change = self.pending.pop(0)
            if self.barrier:
                self.barrier(f"mode@{change.step}", timeout)
            if self.worker_index == 0:
                self.set_mode(change.mode)
            if self.barrier:
                self.barrier(f"mode@{change.step}:switched", timeout)
