"""`Trainer`: a Keras-style `fit` / `evaluate` loop over a PS-backed optimizer."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from paramserver.base.errors import InvalidArgumentError
from paramserver.optim.ps_optimizers import PSOptimizer
from paramserver.worker.context import Context
from paramserver.worker.current import current_context

log = logging.getLogger(__name__)


@dataclass
class EpochMetrics:
    """What one epoch of `fit` did, on this worker."""

    epoch: int
    steps: int
    examples: int
    loss: float
    wall_s: float

    @property
    def examples_per_s(self) -> float:
        return self.examples / self.wall_s if self.wall_s > 0 else 0.0


class Trainer:
    """Runs the training loop of one worker. Not thread-safe; call `fit` from the training thread.

    Each batch is a tuple or list whose last element is the target and whose others are the model's
    inputs (docs/embeddings.md, "Batches Trainer takes"):

    - `(x, y)`: `model(x)`;
    - `(dense, ids, ..., y)`: `model(dense, ids, ...)`;
    - `((dense, ids), y)`: `model(dense, ids)` (a tuple or list of inputs is spread);
    - `({"dense": d, "ids": i}, y)`: `model(dense=d, ids=i)` (a dict of inputs is passed by name).

    A bfloat16 or float16 model gets its floating-point inputs in its own dtype (a loader's float32
    batches are cast), so that the same loop trains a model of any precision."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: PSOptimizer,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        context: Context | None = None,
        verbose: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.context = context or current_context()
        self.verbose = verbose
        self.steps = 0
        floating = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
        self.input_dtype = floating[0] if floating and floating[0] in (torch.bfloat16, torch.float16) else None

    def fit(
        self, loader: Iterable, epochs: int = 1, steps_per_epoch: int | None = None, scheduler: Any = None
    ) -> list[EpochMetrics]:
        """Train for `epochs`; with `steps_per_epoch`, each epoch takes that many batches, cycling `loader`.

        Training starts at this worker's data position (a restarted worker skips what it trained,
        `Context.resumable`), and this worker finishes its data at the end, so that no step of the
        others waits for it. `scheduler` (a torch.optim.lr_scheduler over this trainer's optimizer)
        steps after each epoch, skipped ones too; the new learning rate travels with the next push.
        """
        history = []
        data = self.context.resumable(loader, epochs, steps_per_epoch)
        self.model.train()
        for epoch, batches in data.by_epoch():
            history.append(self._epoch(epoch + 1, batches))
            if scheduler is not None:
                with warnings.catch_warnings():  # an epoch trained before a restart has no optimizer step
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
                    scheduler.step()
            if self.verbose:
                m = history[-1]
                print(
                    f"epoch {epoch + 1}/{epochs}: loss={m.loss:.4f} steps={m.steps} "
                    f"examples/s={m.examples_per_s:,.0f} wall_s={m.wall_s:.2f}",
                    flush=True,
                )
        return history

    def _epoch(self, epoch: int, batches: Iterable) -> EpochMetrics:
        started = time.perf_counter()
        steps = examples = 0
        loss_sum = 0.0
        for batch in batches:
            args, kwargs, y = self._split(batch)
            self.optimizer.zero_grad()
            loss = self.loss_fn(self.model(*args, **kwargs), y)
            loss.backward()
            self.optimizer.step()
            value = loss.item()
            steps, examples, loss_sum = steps + 1, examples + len(y), loss_sum + value
            self.context.report(examples=len(y), loss=value)
        self.steps += steps
        return EpochMetrics(epoch, steps, examples, loss_sum / max(steps, 1), time.perf_counter() - started)

    def _split(self, batch: Any) -> tuple[list, dict, Any]:
        """(positional inputs, inputs by name, target) of one batch; see the class docstring."""
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            shown = type(batch).__name__
            if isinstance(batch, (tuple, list)):
                shown = f"a {shown} of {len(batch)}"
            raise InvalidArgumentError(
                f"Trainer takes batches of (inputs..., target): a tuple or list of at least 2 elements, got {shown}"
            )
        *inputs, y = batch
        if len(inputs) == 1 and isinstance(inputs[0], dict):
            return [], {key: self._input(value) for key, value in inputs[0].items()}, y
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
            inputs = list(inputs[0])
        return [self._input(x) for x in inputs], {}, y

    def _input(self, x: Any) -> Any:
        if self.input_dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(self.input_dtype)
        return x

    @torch.no_grad()
    def evaluate(self, loader: Iterable, pull: bool = True) -> dict[str, Any]:
        """Mean loss and accuracy (for class-index targets) over `loader`, on the PS's current values."""
        if pull:
            self.optimizer.pull()
        self.model.eval()
        total = correct = 0
        loss_sum = 0.0
        for batch in loader:
            args, kwargs, y = self._split(batch)
            out = self.model(*args, **kwargs)
            loss_sum += self.loss_fn(out, y).item() * len(y)
            if out.dim() == 2 and y.dim() == 1:
                correct += (out.argmax(dim=1) == y).sum().item()
            total += len(y)
        self.model.train()
        return {"loss": loss_sum / max(total, 1), "accuracy": correct / max(total, 1), "examples": total}
