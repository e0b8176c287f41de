"""Consistency-mode control from a worker: switching now, or on a schedule of steps."""

from __future__ import annotations

from collections.abc import Sequence

from paramserver.base.consistency_spec import ConsistencySpec, ModeChange
from paramserver.base.errors import ParamServerError


class ModeSwitcher:
    """Switches the cluster's mode through a PSClient; only the chief may. Not thread-safe."""

    def __init__(
        self,
        client,
        worker_index: int,
        num_workers: int,
        schedule: Sequence[ModeChange] = (),
        backup_workers: int = 0,
        barrier=None,
        elastic: bool = False,
    ) -> None:
        """`schedule`: Options.mode_changes (Options checked every mode in it when it was built)."""
        self.client = client
        self.barrier = barrier  # barrier(name, timeout): every worker meets there around a scheduled switch
        self.worker_index = worker_index
        self.num_workers = num_workers
        self.backup_workers = backup_workers
        self.elastic = elastic  # a switch keeps the run elastic (docs/elastic.md)
        self.pending = list(schedule)

    def set_mode(self, mode: str, backup_workers: int | None = None) -> ConsistencySpec:
        if self.worker_index != 0:
            raise ParamServerError(f"only the chief (worker 0) switches modes; this is worker {self.worker_index}")
        backups = self.backup_workers if backup_workers is None else backup_workers
        spec = ConsistencySpec.parse(mode, self.num_workers, backups if mode.startswith("sync") else 0, self.elastic)
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
