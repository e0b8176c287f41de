"""A cluster's consistency mode, as every layer names it: "async", "sync" (with backup
workers) or "ssp:K". What each mode does is the shards' business (server/consistency.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from paramserver.base.errors import InvalidArgumentError

MODES = ("async", "sync", "ssp")


@dataclass(frozen=True)
class ConsistencySpec:
    """A cluster's consistency mode. `workers` 0 means unknown (async only)."""

    mode: str = "async"
    workers: int = 0
    backups: int = 0
    staleness: int = 0  # K of ssp:K
    elastic: bool = False  # `workers` counts slots: workers join and leave while the run trains

    @classmethod
    def parse(cls, text: str, workers: int, backups: int = 0, elastic: bool = False) -> ConsistencySpec:
        """From the command line's form: "async", "sync" or "ssp:K"."""
        name, _, arg = str(text).partition(":")
        common = {"workers": workers, "backups": backups, **({"elastic": True} if elastic else {})}
        if name == "ssp":
            if not arg.isdigit():
                raise InvalidArgumentError(f"mode {text!r}: ssp needs a staleness bound, e.g. ssp:2")
            if int(arg) == 0:
                return cls.from_dict({"mode": "sync", **common})
            return cls.from_dict({"mode": "ssp", **common, "staleness": int(arg)})
        if arg:
            raise InvalidArgumentError(f"mode {text!r}: only ssp takes an argument")
        return cls.from_dict({"mode": name, **common})

    @classmethod
    def from_dict(cls, data: dict) -> ConsistencySpec:
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
        if not isinstance(self.elastic, bool):
            raise InvalidArgumentError(f"elastic must be true or false, got {self.elastic!r}")
        if self.elastic and self.backups:
            raise InvalidArgumentError("an elastic run takes no backup workers: its steps wait for the workers present")
        if self.backups and (self.mode != "sync" or self.backups >= self.workers):
            raise InvalidArgumentError(
                f"{self.backups} backup workers need sync mode and fewer backups than workers ({self.workers})"
            )

    @property
    def quorum(self) -> int:
        """How many workers' gradients a sync step waits for."""
        return self.workers - self.backups

    def to_dict(self) -> dict:
        data = asdict(self)
        if not self.elastic:  # the form every earlier node reads
            del data["elastic"]
        return data

    def __str__(self) -> str:
        text = f"ssp:{self.staleness}" if self.mode == "ssp" else self.mode
        if self.elastic:
            text += f", elastic (up to {self.workers} workers)"
        return text + (f" with {self.backups} backup workers" if self.backups else "")


@dataclass(frozen=True)
class ModeChange:
    """One entry of a mode schedule: switch to `mode` when the workers reach `step`."""

    step: int
    mode: str


def parse_schedule(text: str) -> list[ModeChange]:
    """ "sync@500" or "ssp:2@100,sync@900": switch to MODE when the workers reach STEP. Checks the
    form and the order of the steps; each MODE is checked by ConsistencySpec.parse."""
    changes = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        mode, at, step = entry.rpartition("@")
        if not at or not step.isdigit() or not mode:
            raise InvalidArgumentError(f"mode schedule entry {entry!r} is not MODE@STEP (e.g. sync@500)")
        changes.append(ModeChange(int(step), mode))
    if [c.step for c in changes] != sorted(c.step for c in changes):
        raise InvalidArgumentError(f"mode schedule {text!r} must list steps in increasing order")
    return changes
