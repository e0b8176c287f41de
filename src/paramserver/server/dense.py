"""A group of dense variables that share one optimizer, stored contiguously in float32.

All variables of a group are views into one flat array (and one flat array per optimizer
state), so a push that carries every variable of the group is applied by one optimizer
pass over the whole group. A push that carries only some variables (torch skips
parameters whose .grad is None) is applied per variable with that variable's own step
count, exactly as torch.optim counts steps per parameter.

A variable's values are float32 masters whatever its model's dtype; its **wire dtype** (wire/half.py)
is how its gradients arrive and its values leave: a bfloat16 or float16 model pushes and pulls
half the bytes, the optimizer and its state stay float32.

Not thread-safe: the owning Shard serializes calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from paramserver.base import kernels
from paramserver.base.errors import InvalidArgumentError
from paramserver.server.optimizers import Optimizer
from paramserver.wire.half import WIRE_DTYPES, from_wire, to_wire


@dataclass(frozen=True)
class Slot:
    """Where one variable lives inside its group's flat arrays."""

    name: str
    shape: tuple[int, ...]
    start: int
    stop: int
    wire: str = "float32"  # how its gradients and values travel (wire/half.py)


class DenseGroup:
    """Variables registered together, with one optimizer and its hyperparameters."""

    def __init__(
        self,
        name: str,
        optimizer: Optimizer,
        spec: dict,
        initial: dict[str, np.ndarray],
        wire: dict[str, str] | None = None,
    ) -> None:
        """`wire`: the wire dtype of variables that do not travel as float32, by name."""
        self.name = name
        self.optimizer = optimizer
        self.spec = spec
        self.slots: dict[str, Slot] = {}
        self._wire_buffers: dict[str, np.ndarray] = {}  # pulled values cast to the wire dtype, reused
        start = 0
        for var_name, value in initial.items():
            size = math.prod(value.shape)
            self.slots[var_name] = Slot(
                var_name, tuple(value.shape), start, start + size, (wire or {}).get(var_name, "float32")
            )
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
                array[slot.start : slot.stop] = state[key].reshape(-1)
        self.steps[var_name] = steps

    def view(self, var_name: str) -> np.ndarray:
        """The variable's live values, shaped like the variable (a view, not a copy)."""
        slot = self.slots[var_name]
        return self.values[slot.start : slot.stop].reshape(slot.shape)

    def wire_view(self, var_name: str) -> np.ndarray:
        """The variable's values as they travel: the live view for float32, else a cast into a buffer
        reused by the next call (the caller copies it out under the shard's lock, as it does a view)."""
        slot = self.slots[var_name]
        if slot.wire == "float32":
            return self.view(var_name)
        buffer = self._wire_buffers.get(var_name)
        if buffer is None:
            buffer = self._wire_buffers[var_name] = np.empty(slot.shape, WIRE_DTYPES[slot.wire])
        return to_wire(self.view(var_name), slot.wire, buffer)

    def gradient(self, var_name: str, grad: np.ndarray, bound: float = math.inf) -> np.ndarray:
        """A pushed gradient checked against the variable (dtype as registered, shape, finite and
        at most `bound` in magnitude) and upcast to float32; raises InvalidArgumentError naming
        what is wrong."""
        slot = self.slots[var_name]
        expected = WIRE_DTYPES[slot.wire]
        if grad.dtype != expected:
            travels = f"{slot.wire} (as uint16 bits)" if slot.wire == "bfloat16" else slot.wire
            raise InvalidArgumentError(
                f"gradient of {var_name!r} has dtype {grad.dtype}, but the variable was "
                f"registered to travel as {travels}"
            )
        if tuple(grad.shape) != slot.shape:
            raise InvalidArgumentError(f"gradient of {var_name!r} has shape {tuple(grad.shape)}, expected {slot.shape}")
        grad = from_wire(grad, slot.wire)
        if not kernels.all_within(grad, bound):  # a float16 gradient that overflowed is infinite: refused too
            raise InvalidArgumentError(
                f"gradient of {var_name!r} holds NaN or infinite values (or values above {bound:g} "
                f"in magnitude: max_gradient_magnitude)"
            )
        return grad

    def apply(self, grads: dict[str, np.ndarray]) -> None:
        """Apply one optimizer step from already-validated gradients of some of this group's variables."""
        steps = {self.steps[name] for name in grads}
        # several variables in one fused pass over the group's flat buffer; a single one needs no gathering
        if 1 < len(grads) == len(self.slots) and len(steps) == 1:
            for name, grad in grads.items():
                slot = self.slots[name]
                self._grad[slot.start : slot.stop] = grad.reshape(-1)
            self.optimizer.update(self.values, self._grad, self.state, steps.pop() + 1)
        else:
            for name, grad in grads.items():
                slot = self.slots[name]
                part = slice(slot.start, slot.stop)
                state = {key: array[part] for key, array in self.state.items()}
                self.optimizer.update(self.values[part], grad.reshape(-1), state, self.steps[name] + 1)
        for name in grads:
            self.steps[name] += 1
