"""Consistency modes: when a pushed gradient is applied, and when its pusher may go on.

- ``async``: every push is applied on arrival.
- ``sync``: the gradients of step t from all workers are averaged and applied once; a push
  returns when its step is applied. With B backup workers, step t is applied as soon as
  W - B workers pushed it; later pushes for step t are dropped and counted.
- ``ssp:K`` (stale synchronous parallel): pushes are applied on arrival, but a worker's push
  returns only when that worker is at most K steps ahead of the slowest. ``ssp:0`` is sync.

The Shard calls these under its own lock; nothing here is thread-safe on its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import InvalidArgumentError

MODES = ("async", "sync", "ssp")


@dataclass(frozen=True)
class ConsistencySpec:
    """A cluster's consistency mode. `workers` 0 means unknown (async only)."""

    mode: str = "async"
    workers: int = 0
    backups: int = 0
    staleness: int = 0  # K of ssp:K

    @classmethod
    def parse(cls, text: str, workers: int, backups: int = 0) -> "ConsistencySpec":
        """From the command line's form: "async", "sync" or "ssp:K"."""
        name, _, arg = str(text).partition(":")
        if name == "ssp":
            if not arg.isdigit():
                raise InvalidArgumentError(f"mode {text!r}: ssp needs a staleness bound, e.g. ssp:2")
            if int(arg) == 0:
                return cls.from_dict({"mode": "sync", "workers": workers, "backups": backups})
            return cls.from_dict({"mode": "ssp", "workers": workers, "backups": backups, "staleness": int(arg)})
        if arg:
            raise InvalidArgumentError(f"mode {text!r}: only ssp takes an argument")
        return cls.from_dict({"mode": name, "workers": workers, "backups": backups})

    @classmethod
    def from_dict(cls, data: dict) -> "ConsistencySpec":
        try:
            spec = cls(**data)
        except TypeError as exc:
            raise InvalidArgumentError(f"bad consistency spec {data!r}: {exc}") from None
        spec.validate()
        return spec

    def validate(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgumentError(f"unknown mode {self.mode!r}; known: async, sync, ssp:K")
        for key in ("workers", "backups", "staleness"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 0:
                raise InvalidArgumentError(f"{key} must be a non-negative integer, got {getattr(self, key)!r}")
        if self.mode != "async" and self.workers < 1:
            raise InvalidArgumentError(f"mode {self.mode} needs the number of workers")
        if self.backups and (self.mode != "sync" or self.backups >= self.workers):
            raise InvalidArgumentError(
                f"{self.backups} backup workers need sync mode and fewer backups than workers ({self.workers})")

    @property
    def quorum(self) -> int:
        """How many workers' gradients a sync step waits for."""
        return self.workers - self.backups

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        text = f"ssp:{self.staleness}" if self.mode == "ssp" else self.mode
        return text + (f" with {self.backups} backup workers" if self.backups else "")


@dataclass
class SyncRound:
    """The gradients of one sync step gathered so far: running sums per variable, and who sent them."""

    step: int
    contributors: set[int] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=dict)
    rows: list[list] = field(default_factory=list)  # each contributor's embedding row pushes

    def add(self, worker: int, grads: dict[str, np.ndarray], sums: dict[str, np.ndarray]) -> None:
        """Add a worker's gradients into `sums` (buffers reused across rounds)."""
        self.contributors.add(worker)
        for name, grad in grads.items():
            if self.counts.get(name):
                sums[name] += grad
            else:
                if name not in sums or sums[name].shape != grad.shape:
                    sums[name] = np.empty_like(grad)
                np.copyto(sums[name], grad)
                self.counts[name] = 0
            self.counts[name] += 1

    def averages(self, sums: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Each variable's mean gradient over the workers that sent one (in place in `sums`)."""
        for name, count in self.counts.items():
            if count > 1:
                sums[name] /= np.float32(count)
        return {name: sums[name] for name in self.counts}
