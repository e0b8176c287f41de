"""One parameter-server shard: the variables it holds and the version of their values.

The domain object behind the shard service; it knows nothing of gRPC or frames.
Thread-safe: every public method may be called from many request threads at once; pushes
are applied one at a time, in arrival order (async training).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Iterable, TypeVar

import numpy as np

from ..errors import FailedPreconditionError, InvalidArgumentError, NotFoundError
from .dense import DenseGroup
from .optimizers import build_optimizer, check_lr

log = logging.getLogger(__name__)
T = TypeVar("T")


class Shard:
    """Holds dense variable groups and applies pushed gradients with their optimizer."""

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self.version = 0  # number of pushes applied
        self._groups: dict[str, DenseGroup] = {}
        self._group_of: dict[str, DenseGroup] = {}
        self._lock = threading.Lock()

    def register(self, group: str, optimizer_spec: dict, initial: dict[str, np.ndarray]) -> int:
        """Create a group of variables from initial values, or check an existing one matches.

        The first registration wins: later callers (other workers) receive the stored values
        from `pull`. A mismatched shape or optimizer raises FailedPreconditionError and changes nothing.
        """
        for name, value in initial.items():
            if value.dtype != np.float32:
                raise InvalidArgumentError(f"variable {name!r}: dtype {value.dtype} not supported (float32 only)")
        optimizer = build_optimizer(optimizer_spec)
        with self._lock:
            existing = self._groups.get(group)
            if existing is None:
                clash = sorted(set(initial) & set(self._group_of))
                if clash:
                    raise FailedPreconditionError(f"variables {clash} already belong to another group")
                created = DenseGroup(group, optimizer, optimizer_spec, initial)
                self._groups[group] = created
                self._group_of.update(dict.fromkeys(initial, created))
                log.info("shard %d: registered group %s (%d variables, %d values, %s)", self.index, group,
                         len(initial), created.values.size, optimizer.name)
            else:
                self._check_same(existing, optimizer_spec, initial)
            return self.version

    @staticmethod
    def _check_same(group: DenseGroup, optimizer_spec: dict, initial: dict[str, np.ndarray]) -> None:
        if optimizer_spec != group.spec:
            raise FailedPreconditionError(
                f"group {group.name!r} was registered with optimizer {group.spec}, not {optimizer_spec}")
        if set(initial) != set(group.slots):
            raise FailedPreconditionError(f"group {group.name!r} holds {sorted(group.slots)}, not {sorted(initial)}")
        for name, value in initial.items():
            if tuple(value.shape) != group.slots[name].shape:
                raise FailedPreconditionError(
                    f"variable {name!r} was registered with shape {group.slots[name].shape}, not {tuple(value.shape)}")

    def push(self, grads: dict[str, np.ndarray], lrs: dict[str, float] | None = None) -> int:
        """Validate every gradient, then apply them all; on any error nothing is applied."""
        by_group: dict[DenseGroup, dict[str, np.ndarray]] = {}
        for name, grad in grads.items():
            group = self._lookup(name)
            self._check_grad(group, name, grad)
            by_group.setdefault(group, {})[name] = grad
        for group_name, lr in (lrs or {}).items():
            if group_name not in self._groups:
                raise NotFoundError(f"shard {self.index} holds no group {group_name!r}")
            check_lr(lr)
        with self._lock:
            for group_name, lr in (lrs or {}).items():
                self._groups[group_name].optimizer.set_lr(lr)
            for group, group_grads in by_group.items():
                group.apply(group_grads)
            self.version += 1
            return self.version

    def pull(self, names: Iterable[str], read: Callable[[int, list[tuple[str, np.ndarray]]], T]) -> T:
        """Call `read(version, [(name, live view)])` while no push can change the values.

        `read` must copy what it keeps (e.g. encode a reply frame) and must not call back into the shard.
        """
        views = [(name, self._lookup(name)) for name in names]
        with self._lock:
            return read(self.version, [(name, group.view(name)) for name, group in views])

    def _lookup(self, name: str) -> DenseGroup:
        group = self._group_of.get(name)
        if group is None:
            raise NotFoundError(f"shard {self.index} holds no variable {name!r}")
        return group

    @staticmethod
    def _check_grad(group: DenseGroup, name: str, grad: np.ndarray) -> None:
        slot = group.slots[name]
        if grad.dtype != np.float32:
            raise InvalidArgumentError(f"gradient of {name!r} has dtype {grad.dtype}, expected float32")
        if tuple(grad.shape) != slot.shape:
            raise InvalidArgumentError(f"gradient of {name!r} has shape {tuple(grad.shape)}, expected {slot.shape}")
        if not np.isfinite(grad).all():
            raise InvalidArgumentError(f"gradient of {name!r} holds NaN or infinite values")
