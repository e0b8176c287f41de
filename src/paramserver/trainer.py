"""`Trainer`: a Keras-style `fit` / `evaluate` loop over a PS-backed optimizer."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from paramserver.base.errors import InvalidArgumentError
from paramserver.evaluation.metrics import log_loss, roc_auc
from paramserver.optim.ps_optimizers import PSOptimizer
from paramserver.trainer_callbacks import Callback
from paramserver.worker.context import Context
from paramserver.worker.current import current_context

log = logging.getLogger(__name__)
MetricFn = Callable[[torch.Tensor, torch.Tensor], Any]  # (outputs, targets) of the whole set -> number
Metrics = Sequence[str | MetricFn] | Mapping[str, MetricFn]
METRIC_NAMES = ("auc", "log_loss", "accuracy")
_DEFAULTS = {"binary": METRIC_NAMES, "classes": ("accuracy",), "": ()}  # evaluate's metrics by the model's kind


@dataclass
class EpochMetrics:
    """What one epoch of `fit` did, on this worker."""

    epoch: int
    steps: int
    examples: int
    loss: float
    wall_s: float
    validation: dict[str, float] | None = None  # the epoch's latest validation metrics (fit's validation_data)

    @property
    def examples_per_s(self) -> float:
        return self.examples / self.wall_s if self.wall_s > 0 else 0.0


def _done_before(epochs_done: int, epochs: int) -> str:
    """The line `fit` prints for the epochs a restarted worker had trained before its restart."""
    done = "epoch 1" if epochs_done == 1 else f"epochs 1-{epochs_done}"
    return f"{done}/{epochs} done before the resume"


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
        self.stop_training = False  # set by a callback: fit stops after the current step
        floating = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
        self.input_dtype = floating[0] if floating and floating[0] in (torch.bfloat16, torch.float16) else None

    def fit(
        self,
        loader: Iterable,
        epochs: int = 1,
        steps_per_epoch: int | None = None,
        scheduler: Any = None,
        *,
        validation_data: Iterable | None = None,
        validation_every: int | None = None,
        metrics: Metrics | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> list[EpochMetrics]:
        """Train for `epochs`; with `steps_per_epoch`, each epoch takes that many batches, cycling `loader`.

        Training starts at this worker's data position (a restarted worker skips what it trained,
        `Context.resumable`), and this worker finishes its data at the end, so that no step of the
        others waits for it. `scheduler` (a torch.optim.lr_scheduler over this trainer's optimizer)
        steps after each epoch, skipped ones too; the new learning rate travels with the next push.

        `validation_data` (iterated again at each validation) is evaluated (`evaluate`, with
        `metrics`) every `validation_every` steps of this trainer, or at the end of each epoch when
        None; its metrics go to the log, to TensorBoard as ``validation/<metric>`` (the chief, with a
        logdir) and to `callbacks` as ``val_<metric>``. A callback that sets `stop_training` ends
        `fit` after the current step.
        """
        if validation_every is not None and validation_every < 1:
            raise InvalidArgumentError(f"validation_every must be a step count of 1 or more, got {validation_every}")
        if validation_every is not None and validation_data is None:
            raise InvalidArgumentError("validation_every needs validation_data: the data to validate on")
        names_metrics(metrics)  # a bad name is refused before any step
        for callback in callbacks:
            monitor = getattr(callback, "monitor", "")
            if validation_data is None and isinstance(monitor, str) and monitor.startswith("val_"):
                raise InvalidArgumentError(
                    f"{type(callback).__name__} monitors {monitor!r}, a validation metric: it needs "
                    "fit(validation_data=...)"
                )
        run = _Run(validation_data, validation_every, metrics, list(callbacks))
        self.stop_training = False
        history = []
        data = self.context.resumable(loader, epochs, steps_per_epoch)
        self.model.train()
        run.call("on_train_begin", self)
        done_before = 0  # the leading epochs trained before this worker's restart: one line, not one each
        for epoch, batches in data.by_epoch():
            skipped = data.skipped
            history.append(self._epoch(epoch + 1, batches, run))
            if scheduler is not None:
                with warnings.catch_warnings():  # an epoch trained before a restart has no optimizer step
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler")
                    scheduler.step()
            if done_before == epoch and history[-1].steps == 0 and data.skipped > skipped:
                done_before += 1
                continue
            if self.verbose and done_before and done_before == epoch:
                print(_done_before(done_before, epochs), flush=True)
            self._epoch_end(history[-1], epochs, run)
            if self.stop_training:
                self.context.finish_training()  # by_epoch would at its end: no step of the others waits
                break
        if self.verbose and done_before == epochs:
            print(_done_before(done_before, epochs), flush=True)
        run.call("on_train_end", self)
        return history

    def _epoch_end(self, m: EpochMetrics, epochs: int, run: _Run) -> None:
        if run.data is not None and run.every is None and m.steps > 0:
            m.validation = self._validate(run)
        if self.verbose:
            shown = "".join(f" val_{key}={value:.4f}" for key, value in (m.validation or {}).items())
            print(
                f"epoch {m.epoch}/{epochs}: loss={m.loss:.4f} steps={m.steps} "
                f"examples/s={m.examples_per_s:,.0f} wall_s={m.wall_s:.2f}{shown}",
                flush=True,
            )
        if m.steps > 0:  # an epoch trained before a restart calls back nothing
            logs = {"loss": m.loss, **{f"val_{key}": value for key, value in (run.latest or {}).items()}}
            run.call("on_epoch_end", self, m.epoch, logs)

    def _validate(self, run: _Run) -> dict[str, float]:
        """Evaluate the validation data now; log, TensorBoard, callbacks."""
        if run.data is None:
            return {}
        result = self.evaluate(run.data, metrics=run.metrics)
        values = {key: float(value) for key, value in result.items() if key != "examples"}
        run.latest = values
        shown = " ".join(f"{key}={value:.6g}" for key, value in values.items())
        log.info("validation at step %d: %s", self.steps, shown, extra={"event": "validation", "step": self.steps})
        for key, value in values.items():
            self.context.log_scalar(f"validation/{key}", value)
        run.call("on_validation_end", self, self.steps, {f"val_{key}": value for key, value in values.items()})
        return values

    def _epoch(self, epoch: int, batches: Iterable, run: _Run) -> EpochMetrics:
        started = time.perf_counter()
        steps = examples = 0
        loss_sum = 0.0
        validation = None
        for batch in batches:
            args, kwargs, y = self._split(batch)
            self.optimizer.zero_grad()
            loss = self.loss_fn(self.model(*args, **kwargs), y)
            loss.backward()
            self.optimizer.step()
            value = loss.item()
            steps, examples, loss_sum = steps + 1, examples + len(y), loss_sum + value
            self.steps += 1
            self.context.report(examples=len(y), loss=value)
            if run.every is not None and run.data is not None and self.steps % run.every == 0:
                validation = self._validate(run)
            if self.stop_training:
                break
        took = time.perf_counter() - started
        return EpochMetrics(epoch, steps, examples, loss_sum / max(steps, 1), took, validation)

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
    def evaluate(self, loader: Iterable, pull: bool = True, metrics: Metrics | None = None) -> dict[str, Any]:
        """Mean loss and `metrics` over `loader`, on the PS's current values (pulled first with `pull`).

        Returns ``{"loss", <metrics>..., "examples"}``. By default, a binary model (one output per
        example, 0/1 targets) gets "auc", "log_loss" and "accuracy" (at probability 0.5); a
        classifier (a row of class scores per example, class-index targets) "accuracy"; another
        model the loss alone. `metrics` names them ("auc", "log_loss", "accuracy") or gives
        callables `fn(outputs, targets) -> number` over the whole set's outputs (a list: named by
        the function's name; a dict: by its key). A binary model's outputs are logits with
        BCEWithLogitsLoss, probabilities with BCELoss, and otherwise probabilities when all lie in
        [0, 1]; AUC is NaN (and logged) when the targets hold one class only."""
        named = names_metrics(metrics)
        if pull:
            self.optimizer.pull()
        was_training = self.model.training
        self.model.eval()
        outputs, targets = [], []
        total, loss_sum = 0, 0.0
        try:
            for batch in loader:
                args, kwargs, y = self._split(batch)
                out = self.model(*args, **kwargs)
                loss_sum += self.loss_fn(out, y).item() * len(y)
                outputs.append(out.detach().float().cpu())
                targets.append(y.detach().cpu())
                total += len(y)
        finally:
            self.model.train(was_training)
        result: dict[str, Any] = {"loss": loss_sum / max(total, 1)}
        if total:
            result.update(self._metrics(named, torch.cat(outputs), torch.cat(targets)))
        result["examples"] = total
        return result

    def _metrics(self, named: dict[str, MetricFn | str] | None, out: torch.Tensor, y: torch.Tensor) -> dict:
        kind = _kind(out, y)
        if named is None:
            named = {name: name for name in _DEFAULTS[kind]}
        values = {}
        for key, fn in named.items():
            values[key] = float(fn(out, y)) if callable(fn) else self._named_metric(fn, kind, out, y)
        return values

    def _named_metric(self, name: str, kind: str, out: torch.Tensor, y: torch.Tensor) -> float:
        if name == "accuracy" and kind == "classes":
            return (out.argmax(dim=1) == y).double().mean().item()
        if kind != "binary":
            raise InvalidArgumentError(
                f"metric {name!r} needs a binary model (one output per example, 0/1 targets)"
                + (" or a classifier (class scores, class-index targets)" if name == "accuracy" else "")
                + f"; got outputs of shape {tuple(out.shape)} and targets of shape {tuple(y.shape)}"
            )
        labels = y.reshape(-1).double().numpy()
        p = self._probabilities(out).reshape(-1).double().numpy()
        if name == "log_loss":
            return log_loss(labels, p)
        if name == "accuracy":
            return float(np.mean((p >= 0.5) == (labels >= 0.5)))
        if labels.min() == labels.max():
            log.warning("AUC is undefined on targets of one class only (%d examples): NaN", labels.size)
            return float("nan")
        return roc_auc(labels, p)

    def _probabilities(self, out: torch.Tensor) -> torch.Tensor:
        """A binary model's outputs as probabilities of the positive class (see `evaluate`)."""
        fn = self.loss_fn
        if isinstance(fn, torch.nn.BCEWithLogitsLoss) or fn is F.binary_cross_entropy_with_logits:
            return torch.sigmoid(out)
        if isinstance(fn, torch.nn.BCELoss) or fn is F.binary_cross_entropy:
            return out
        return out if bool(out.min() >= 0) and bool(out.max() <= 1) else torch.sigmoid(out)


@dataclass
class _Run:
    """What one `fit` validates on and calls back."""

    data: Iterable | None
    every: int | None
    metrics: Metrics | None
    callbacks: list[Callback]
    latest: dict[str, float] | None = field(default=None)

    def call(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(*args)


def names_metrics(metrics: Metrics | None) -> dict[str, MetricFn | str] | None:
    """`metrics` by the name each gets in the results (None: the model's defaults); an unknown
    name or something neither a name nor a callable is refused."""
    if metrics is None:
        return None
    items = list(metrics.items()) if isinstance(metrics, Mapping) else [(_name(m), m) for m in metrics]
    for key, fn in items:
        if isinstance(fn, str) and fn not in METRIC_NAMES:
            raise InvalidArgumentError(
                f"unknown metric {fn!r}: the named ones are {list(METRIC_NAMES)}, or give a callable"
            )
        if key in ("loss", "examples"):
            raise InvalidArgumentError(f"metric name {key!r} is taken: evaluate always returns it")
        if not isinstance(fn, str) and not callable(fn):
            raise InvalidArgumentError(f"metric {key!r} must be a name or a callable (outputs, targets), got {fn!r}")
    return dict(items)


def _name(metric: str | MetricFn) -> str:
    return metric if isinstance(metric, str) else getattr(metric, "__name__", type(metric).__name__)


def _kind(out: torch.Tensor, y: torch.Tensor) -> str:
    """The model's kind: "binary" (one output per example, 0/1 targets), "classes" (class scores,
    class-index targets) or "" (another)."""
    if out.dim() > 0 and out.numel() == y.numel() == out.shape[0] and bool(((y == 0) | (y == 1)).all()):
        return "binary"
    if (
        out.dim() == 2
        and y.dim() == 1
        and out.shape[0] == y.shape[0]
        and out.shape[1] > 1
        and not y.is_floating_point()
    ):
        return "classes"
    return ""
