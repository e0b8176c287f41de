"""Callbacks of `Trainer.fit`, in the Keras/Lightning shape: `EarlyStopping` and `BestCheckpoint`.

`fit` calls each callback's hooks from the training thread, in the order the list gives:
`on_train_begin(trainer)`, `on_validation_end(trainer, step, logs)` after each evaluation on the
validation data (`logs`: ``{"val_loss": ..., "val_auc": ...}``), `on_epoch_end(trainer, epoch,
logs)` (`logs`: the epoch's ``loss`` and the latest ``val_*``), `on_train_end(trainer)`. A callback
stops training by setting `trainer.stop_training = True`: `fit` stops after the current step and
this worker finishes its data (no step of the others waits for it).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from paramserver.base.errors import InvalidArgumentError

if TYPE_CHECKING:
    from paramserver.trainer import Trainer

log = logging.getLogger(__name__)
_HIGHER_IS_BETTER = ("auc", "acc")  # mode "auto": metrics whose name holds one of these are maximised


class Callback:
    """A no-op base: override the hooks you need. Not thread-safe (the training thread calls it)."""

    def on_train_begin(self, trainer: Trainer) -> None:
        """Before the first step of `fit`."""

    def on_validation_end(self, trainer: Trainer, step: int, logs: dict[str, float]) -> None:
        """After an evaluation on the validation data, at this trainer's step `step`."""

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict[str, float]) -> None:
        """After epoch `epoch` (from 1) and its validation, if one ran at its end."""

    def on_train_end(self, trainer: Trainer) -> None:
        """After the last step of `fit` (or the step at which a callback stopped it)."""


class _Monitor(Callback):
    """Follows one metric of the logs: `monitor` (a ``val_`` one is read after each validation,
    another at each epoch's end), improving by more than `min_delta` towards `mode`
    ("min", "max", or "auto": max for AUC and accuracy, min otherwise)."""

    def __init__(self, monitor: str, mode: str, min_delta: float) -> None:
        if mode not in ("auto", "min", "max"):
            raise InvalidArgumentError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        if not min_delta >= 0:
            raise InvalidArgumentError(f"min_delta must be 0 or more, got {min_delta}")
        self.monitor = monitor
        self.min_delta = float(min_delta)
        if mode == "auto":
            mode = "max" if any(word in monitor.lower() for word in _HIGHER_IS_BETTER) else "min"
        self.mode = mode
        self.best: float | None = None
        self.best_step: int | None = None  # the trainer's step at the best value

    def on_validation_end(self, trainer: Trainer, step: int, logs: dict[str, float]) -> None:
        if self.monitor.startswith("val_"):
            self._seen(trainer, step, logs)

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict[str, float]) -> None:
        if not self.monitor.startswith("val_"):
            self._seen(trainer, trainer.steps, logs)

    def _seen(self, trainer: Trainer, step: int, logs: dict[str, float]) -> None:
        if self.monitor not in logs:
            raise InvalidArgumentError(
                f"{type(self).__name__} monitors {self.monitor!r}, which the logs do not have: they have "
                f"{sorted(logs)} (validation metrics need fit(validation_data=...))"
            )
        value = float(logs[self.monitor])
        if math.isnan(value):
            self.waited(trainer, step, value)
            return
        better = self.best is None or (
            value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta
        )
        if better:
            self.best, self.best_step = value, step
            self.improved(trainer, step, value)
        else:
            self.waited(trainer, step, value)

    def improved(self, trainer: Trainer, step: int, value: float) -> None:
        """The monitored metric improved to `value` at `step`."""

    def waited(self, trainer: Trainer, step: int, value: float) -> None:
        """The monitored metric did not improve (`value`, maybe NaN) at `step`."""


class EarlyStopping(_Monitor):
    """Stop `fit` once `monitor` has not improved by more than `min_delta` for `patience` checks
    in a row (validations for a ``val_`` metric, epochs otherwise). Each worker decides from its own
    logs; `stopped_step` is the trainer's step at which it stopped (None: it did not)."""

    def __init__(self, monitor: str = "val_loss", patience: int = 0, min_delta: float = 0.0, mode: str = "auto"):
        super().__init__(monitor, mode, min_delta)
        if patience < 0:
            raise InvalidArgumentError(f"patience must be 0 or more, got {patience}")
        self.patience = patience
        self.wait = 0
        self.stopped_step: int | None = None

    def on_train_begin(self, trainer: Trainer) -> None:
        self.wait, self.stopped_step, self.best, self.best_step = 0, None, None, None

    def improved(self, trainer: Trainer, step: int, value: float) -> None:
        self.wait = 0

    def waited(self, trainer: Trainer, step: int, value: float) -> None:
        self.wait += 1
        if self.wait > self.patience:
            self.stopped_step = step
            trainer.stop_training = True
            log.info(
                "early stopping at step %d: %s=%.6g, no improvement on the best %.6g (step %s) for %d checks",
                step,
                self.monitor,
                value,
                self.best if self.best is not None else math.nan,
                self.best_step,
                self.wait,
                extra={"event": "early_stopping", "step": step},
            )


class BestCheckpoint(_Monitor):
    """Ask for a checkpoint each time `monitor` reaches a new best (on the chief, with a
    checkpoint_dir): the coordinator announces it and every worker meets for it after its next
    step, as for a periodic one (worker/recovery/checkpoints.py). The checkpoint is the PS's
    consistent cut of every shard, so the best model is kept whatever the tables' size; it is named
    by the run's step at that next step (in async mode it holds what the others pushed meanwhile).
    `requested` counts the requests; `best` and `best_step` say which value earned the last one.
    Older checkpoints are pruned as ever (`checkpoint_keep`): keep enough for the best one to stay.
    Elsewhere (another worker, no checkpoint_dir) it only follows the metric, and says so once."""

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, mode: str = "auto") -> None:
        super().__init__(monitor, mode, min_delta)
        self.requested = 0
        self._said_why_not = False

    def improved(self, trainer: Trainer, step: int, value: float) -> None:
        context: Any = trainer.context
        if not context.is_chief or context.checkpointer is None:
            if not self._said_why_not:
                self._said_why_not = True
                where = "this worker is not the chief" if not context.is_chief else "there is no checkpoint_dir"
                log.info("BestCheckpoint: %s; the best %s is followed, not saved", where, self.monitor)
            return
        context.coordinator.request_checkpoint()
        self.requested += 1
        log.info(
            "new best %s=%.6g at step %d: checkpoint requested",
            self.monitor,
            value,
            step,
            extra={"event": "best_checkpoint", "step": step},
        )
