"""The evaluator task (TF's SidecarEvaluator): follows a run's checkpoints and evaluates each new one.

An evaluator only reads checkpoints: it never calls a PS, never joins the coordinator, and nothing
waits for it, so it can neither slow nor stop training. It polls `checkpoint_dir` for the newest
complete checkpoint (one with a manifest: a checkpoint being written is never read), loads it into
the user's model with no PS (serving/checkpoint_model.py) once it passes the verdict that resume
applies (checkpoint/verdict.py; one that does not is logged, and the newest one before it that
passes and was not evaluated yet is evaluated instead), calls the user's function and logs its
metrics (event "evaluation") and, with a `logdir`, writes them to TensorBoard as `eval/<metric>`
under `<logdir>/eval`. When it falls behind it skips to the newest checkpoint, as TF's does. A
checkpoint that cannot be read, or a function that raises, is logged and the evaluator waits for
the next one. It ends after the checkpoint whose manifest says `"final": true` (the run's last),
or after `eval_timeout_s` without a new checkpoint (0: never).

docs/evaluator.md has the script's side: `ctx.is_evaluator`, `ctx.evaluate(model, fn)`.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from paramserver.base.config import EVALUATOR, NodeConfig, Options
from paramserver.base.errors import ConfigError, FailedPreconditionError
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointError, CheckpointStore
from paramserver.checkpoint.verdict import check_checkpoint
from paramserver.serving.checkpoint_model import load_into
from paramserver.worker import current
from paramserver.worker.summaries import event_writer

log = logging.getLogger(__name__)
EVAL_SUBDIR = "eval"  # a run of its own in TensorBoard: it reads only the newest event file of a directory

EvalFn = Callable[..., Mapping[str, Any]]  # fn(model) or fn(model, step) -> {metric: number}


@dataclass(frozen=True)
class Evaluation:
    """One checkpoint evaluated: its metrics, or why there are none."""

    checkpoint: str
    step: int
    metrics: dict[str, float] | None
    error: str | None = None
    final: bool = False


class Evaluator:
    """The follow loop over one checkpoint store. `run()` in the caller's thread; `stop()` from any."""

    def __init__(
        self,
        model: torch.nn.Module,
        fn: EvalFn,
        store: CheckpointStore,
        writer: Any = None,
        timeout_s: float = 0.0,
        poll_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model, self.fn, self.store, self.writer = model, fn, store, writer
        self.timeout_s, self.poll_s, self._clock = timeout_s, poll_s, clock
        self._takes_step = _takes_step(fn)
        self._stopped = threading.Event()
        self._tried: tuple[str, Any] | None = None  # (name, manifest time) of the checkpoint tried last
        self._warned = ""  # the listing error logged last: once, not at every poll
        self._loaded = ""  # the checkpoint loaded last
        self._refused = ""  # the checkpoint the verdict refused last (checkpoint/verdict.py)
        self._listed: list[str] = []  # the complete checkpoints, as listed last

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> list[Evaluation]:
        """Evaluate each new checkpoint until the final one, the timeout, or `stop()`."""
        done: list[Evaluation] = []
        idle_since = self._clock()
        log.info("evaluator: following the checkpoints in %s", self.store.url)
        while not self._stopped.is_set():
            newest = self._newest()
            if newest is None:
                if self.timeout_s and self._clock() - idle_since >= self.timeout_s:
                    log.warning(
                        "evaluator: no new checkpoint in %s for %.0fs (eval_timeout_s); ending without the "
                        "final checkpoint",
                        self.store.url,
                        self.timeout_s,
                    )
                    break
                self._stopped.wait(self.poll_s)
                continue
            idle_since = self._clock()
            name, manifest = newest
            if self._tried == (name, manifest.get("time")) and done and done[-1].metrics is not None:
                log.info("evaluator: evaluated the final checkpoint %s (marked final since); done", name)
                break  # marked final since: the same state
            done.append(self._evaluate(name, manifest))
            if done[-1].error is not None and self._refused == name and (older := self._newest_passing_before(name)):
                done.append(self._evaluate(*older))  # the newest that passes the verdict, not evaluated yet
            if done[-1].final:
                log.info("evaluator: evaluated the final checkpoint %s; done", name)
                break
        return done

    def _newest(self) -> tuple[str, dict] | None:
        """The newest complete checkpoint and its manifest, unless it was tried already (same name
        and manifest) and is not final; None too when there is none or it cannot be read."""
        try:
            complete = self._listed = self.store.complete()
            if not complete or (self._tried is not None and complete[-1] < self._tried[0]):
                return None
            manifest = self.store.manifest(complete[-1])
        except CheckpointError as exc:
            self._warn(f"evaluator: {exc}; trying again")
            return None
        self._warned = ""
        if self._tried == (complete[-1], manifest.get("time")) and manifest.get("final") is not True:
            return None
        return complete[-1], manifest

    def _newest_passing_before(self, name: str) -> tuple[str, dict] | None:
        """The newest checkpoint before `name` (refused) and after the one loaded last that passes
        the verdict, with its manifest; None when there is none (each refused one is logged)."""
        candidates = [older for older in self._listed if self._loaded < older < name]
        for older in reversed(candidates):
            try:
                check_checkpoint(self.store, older)
                return older, self.store.manifest(older)
            except CheckpointError as exc:
                log.warning("evaluator: %s does not pass its checks either: %s", older, exc)
        return None

    def _warn(self, message: str) -> None:
        if message != self._warned:
            log.warning("%s", message)
            self._warned = message

    def _evaluate(self, name: str, manifest: dict) -> Evaluation:
        """Load checkpoint `name` and call the function; nothing raised (Exception) gets out."""
        step, started = int(manifest.get("step", 0)), time.monotonic()
        self._tried = (name, manifest.get("time"))
        try:
            try:
                source = RestoreSource(self.store, name)  # the verdict resume applies (checkpoint/verdict.py)
            except CheckpointError:
                self._refused = name
                raise
            self._tried = (name, source.manifest.get("time"))  # (a same-name rewrite read meanwhile)
            load_into(self.model, source)
            self._loaded = name
        except Exception as exc:  # damaged, pruned meanwhile, another model: the next one may do
            log.error(
                "evaluator: cannot load %s: %s; waiting for the next checkpoint",
                name,
                exc,
                extra={"event": "evaluation_failed", "step": step},
            )
            return Evaluation(name, step, None, f"{type(exc).__name__}: {exc}", manifest.get("final") is True)
        final = source.manifest.get("final") is True
        try:
            metrics = self._call(step)
        except Exception as exc:  # the user's function: logged with its traceback
            log.exception(
                "evaluator: the evaluation function failed on %s (step %d); waiting for the next checkpoint",
                name,
                step,
                extra={"event": "evaluation_failed", "step": step},
            )
            return Evaluation(name, step, None, f"{type(exc).__name__}: {exc}", final)
        self._report(name, step, metrics, time.monotonic() - started)
        return Evaluation(name, step, metrics, None, final)

    def _call(self, step: int) -> dict[str, float]:
        self.model.eval()
        with torch.no_grad():
            result = self.fn(self.model, step) if self._takes_step else self.fn(self.model)
        if not isinstance(result, Mapping):
            raise TypeError(f"the evaluation function must return a dict of metric -> number, got {result!r}")
        return {
            str(key): float(value.detach() if isinstance(value, torch.Tensor) else value)
            for key, value in result.items()
        }

    def _report(self, name: str, step: int, metrics: dict[str, float], took: float) -> None:
        shown = " ".join(f"{key}={value:.6g}" for key, value in metrics.items())
        log.info(
            "evaluation of %s (step %d): %s",
            name,
            step,
            shown or "no metrics",
            extra={
                "event": "evaluation",
                "step": step,
                "checkpoint": name,
                "metrics": metrics,
                "duration_s": round(took, 3),
            },
        )
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(f"eval/{key}", value, step)
            self.writer.flush()


def _takes_step(fn: EvalFn) -> bool:
    """Whether `fn` takes (model, step) rather than (model)."""
    try:
        inspect.signature(fn).bind(None, None)
    except (TypeError, ValueError):
        return False
    return True


def follow(
    model: torch.nn.Module,
    fn: EvalFn,
    options: Options,
    checkpoint_dir: str | None = None,
    logdir: str | None = None,
    timeout_s: float | None = None,
    poll_s: float = 1.0,
) -> list[Evaluation]:
    """Evaluate the run's checkpoints until its final one; the arguments override `options`
    (`checkpoint_dir`, `logdir`, `eval_timeout_s`). Returns what was evaluated, in order."""
    directory = checkpoint_dir or options.checkpoint_dir
    if not directory:
        raise ConfigError(
            "the evaluator needs the run's checkpoint directory: --checkpoint-dir (the same as the "
            "training nodes'), or evaluate(..., checkpoint_dir=...)"
        )
    timeout = options.eval_timeout_s if timeout_s is None else timeout_s
    if timeout < 0 or poll_s <= 0:
        raise ConfigError(f"evaluate(): timeout_s must be 0 or more and poll_s positive, got {timeout} and {poll_s}")
    logdir = options.logdir if logdir is None else logdir
    writer = event_writer(f"{logdir.rstrip('/')}/{EVAL_SUBDIR}") if logdir else None
    try:
        return Evaluator(model, fn, CheckpointStore(directory), writer, timeout, poll_s).run()
    finally:
        if writer is not None:
            writer.close()


class EvaluatorContext:
    """What `paramserver.init()` returns on an evaluator task: no PS, no coordinator; the script
    calls `evaluate(model, fn)` instead of training."""

    is_evaluator = True
    is_chief = False
    role = EVALUATOR

    def __init__(self, config: NodeConfig | None, options: Options) -> None:
        self.config = config
        self.options = options
        self.index = config.task.index if config is not None else 0

    def evaluate(self, model: torch.nn.Module, fn: EvalFn, **kwargs: Any) -> list[Evaluation]:
        """Follow the run's checkpoints and evaluate each new one with `fn(model)` or `fn(model,
        step)` -> {metric: number}, until the final checkpoint (see `follow` for `kwargs`)."""
        return follow(model, fn, self.options, **kwargs)

    def add_optimizer(self, optimizer: Any) -> str:
        """A PS optimizer created here: refused, as an evaluator has no PS."""
        raise FailedPreconditionError(
            "this is an evaluator task: it does not train and reaches no PS. Create the "
            "optimizer only when not ctx.is_evaluator, and call ctx.evaluate(model, fn) "
            "there instead (docs/evaluator.md)"
        )

    def next_optimizer_name(self) -> str:
        """Refused as `add_optimizer` (a PS optimizer asks this first)."""
        return self.add_optimizer(None)

    def rollback_reason(self) -> str | None:
        """Never: an evaluator is no part of a roll-back (it follows whatever checkpoints come)."""
        return None

    def shutdown(self, completed: bool = False) -> None:
        """Nothing to leave: an evaluator joined nothing."""
        current.forget(self)


def evaluate(model: torch.nn.Module, fn: EvalFn, **kwargs: Any) -> list[Evaluation]:
    """`paramserver.evaluate`: on an evaluator task, follow the run's checkpoints (as
    `ctx.evaluate`); with no cluster configured, the checkpoints of `checkpoint_dir=`. Refused on a
    training task, whose own final checkpoint would never come while it waits here."""
    ctx = current.existing()
    if ctx is None:
        config = current.node_config()
        if config is None:
            return follow(model, fn, Options(), **kwargs)
        if config.task.type == EVALUATOR:
            ctx = current.adopt(EvaluatorContext(config, config.options))
    if not getattr(ctx, "is_evaluator", False):
        raise FailedPreconditionError(
            "paramserver.evaluate() runs on an evaluator task (TF_CONFIG task type "
            "'evaluator'); a training task trains: test ctx.is_evaluator first"
        )
    return cast(EvaluatorContext, ctx).evaluate(model, fn, **kwargs)  # the one context that is an evaluator
