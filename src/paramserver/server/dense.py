"""A group of dense float32 variables that share one optimizer, stored contiguously.

All variables of a group are views into one flat array (and one flat array per optimizer
state), so a push that carries every variable of the group is applied by one optimizer
pass over the whole group. A push that carries only some variables (torch skips
parameters whose .grad is None) is applied per variable with that variable's own step
count, exactly as torch.optim counts steps per parameter.

Not thread-safe: the owning Shard serializes calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .optimizers import Optimizer


@dataclass(frozen=True)
class Slot:
    """Where one variable lives inside its group's flat arrays."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int


class DenseGroup:
    """Variables registered together, with one optimizer and its hyperparameters."""

    def __init__(self, name: str, optimizer: Optimizer, spec: dict, initial: dict[str, np.ndarray]) -> None:
        self.name = name
        self.optimizer = optimizer
        self.spec = spec
        self.slots: dict[str, Slot] = {}
        start = 0
        for var_name, value in initial.items():
            size = math.prod(value.shape)
            self.slots[var_name] = Slot(var_name, tuple(value.shape), start, start + size)
            start += size
        self.values = np.empty(start, np.float32)
        for var_name, value in initial.items():
            self.view(var_name)[...] = value
        self.state = optimizer.init_state(start)
        self.steps = {var_name: 0 for var_name in self.slots}
        self._grad = np.empty(start, np.float32)

    def load(self, var_name: str, value: np.ndarray, state: dict[str, np.ndarray], steps: int) -> None:
        """Set one variable's values, optimizer state and step count (restoring a checkpoint)."""
        slot = self.slots[var_name]
        self.view(var_name)[...] = value
        for key, array in self.state.items():
            if key in state:
                array[slot.start:slot.stop] = state[key].reshape(-1)
        self.steps[var_name] = steps

    def view(self, var_name: str) -> np.ndarray:
        """The variable's live values, shaped like the variable (a view, not a copy)."""
        slot = self.slots[var_name]
        return self.values[slot.start:slot.stop].reshape(slot.shape)

    def apply(self, grads: dict[str, np.ndarray]) -> None:
        """Apply one optimizer step from already-validated gradients of some of this group's variables."""
        steps = {self.steps[name] for name in grads}
        # several variables in one fused pass over the group's flat buffer; a single one needs no gathering
        if 1 < len(grads) == len(self.slots) and len(steps) == 1:
            for name, grad in grads.items():
                slot = self.slots[name]
                self._grad[slot.start:slot.stop] = grad.reshape(-1)
            self.optimizer.update(self.values, self._grad, self.state, steps.pop() + 1)
        else:
            for name, grad in grads.items():
                slot = self.slots[name]
                part = slice(slot.start, slot.stop)
                state = {key: array[part] for key, array in self.state.items()}
                self.optimizer.update(self.values[part], grad.reshape(-1), state, self.steps[name] + 1)
        for name in grads:
            self.steps[name] += 1
