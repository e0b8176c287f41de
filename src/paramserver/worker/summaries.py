"""TensorBoard summaries of the chief's training (docs/operations.md, "TensorBoard").

With `logdir` set, the chief (worker 0) writes event files there through torch's SummaryWriter,
every `summary_every` of its optimizer steps:

- scalars: `loss` (the latest the script reported), `examples_per_s`, `staleness/last` and
  `staleness/mean` (in versions, from the shards' push replies), `gradient_norm/<variable>`,
  `rows_per_step/<table>` (rows of an embedding table updated per step, its update frequency);
- histograms: `gradients/<variable>` and `parameters/<variable>`.

Norms and histograms are computed on summary steps only; between them a step costs a counter or
two. Without a logdir, or on any other worker, there is no Summaries object at all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from paramserver.base.lifecycle import Lifecycle

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

log = logging.getLogger(__name__)


class Summaries(Lifecycle):
    """The chief's summary writer. Not thread-safe: the training thread calls it (the optimizer's
    step, Context.report, log_scalar).

    Lifecycle (base/lifecycle.py): `start()` opens the event file (nothing is written before);
    `wait_ready` has nothing to wait for; `stop(grace)` flushes and closes it, joining the
    writer's thread (idempotent). Calls after `stop` write nothing.
    """

    def __init__(self, logdir: str, every: int, record: Any) -> None:
        self.logdir = logdir
        self.every = every
        self.step = 0  # the latest optimizer step seen
        self._record = record  # the client's PushRecord: staleness of this worker's pushes
        self._writer: SummaryWriter | None = None
        self._loss_step = -1  # the step whose loss was written last
        self._window = _Window(time.perf_counter(), 0, 0)
        self._examples = 0
        self._steps = 0
        self._rows: dict[str, int] = {}

    def start(self) -> None:
        self._writer = event_writer(self.logdir)
        self._window = _Window(time.perf_counter(), self._record.staleness_sum, self._record.pushes)
        log.info("TensorBoard summaries every %d steps in %s", self.every, self.logdir)

    def wait_ready(self, timeout: float) -> None:
        """Ready once started: the writer opened its file in `start`."""

    def stop(self, grace: float = 2.0) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()  # flushes, then joins tensorboard's writer thread

    def due(self, step: int) -> bool:
        return self._due_writer(step) is not None

    def _due_writer(self, step: int) -> SummaryWriter | None:
        """The writer when `step` is a summary step (and the writer is open), else None."""
        return self._writer if self._writer is not None and step % self.every == 0 else None

    def note_rows(self, table: str, rows: int) -> None:
        """Rows of `table` the coming step updates."""
        self._rows[table] = self._rows.get(table, 0) + rows

    def report(self, examples: int = 0, loss: float | None = None) -> None:
        """What the script reported after a step (Context.report): the loss of a summary step is written."""
        self._examples += examples
        writer = self._due_writer(self.step) if loss is not None else None
        if writer is not None and self._loss_step != self.step and self.step > 0:
            writer.add_scalar("loss", loss, self.step)
            self._loss_step = self.step

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        """A scalar of the script's own, at `step` (default: the latest optimizer step)."""
        if self._writer is not None:
            self._writer.add_scalar(name, value, self.step if step is None else step)

    def on_step(self, step: int, variables: Iterable[tuple[str, torch.Tensor]]) -> None:
        """After the optimizer's step `step` pushed the gradients of `variables` (name, parameter)."""
        self.step = step
        self._steps += 1
        writer = self._due_writer(step)
        if writer is None:
            return
        self._write_rates(writer, step)
        for name, param in variables:  # in float32: tensorboard's numpy has no bfloat16
            if param.grad is not None:
                grad = param.grad.detach().float()
                writer.add_scalar(f"gradient_norm/{name}", torch.linalg.vector_norm(grad).item(), step)
                writer.add_histogram(f"gradients/{name}", grad.cpu(), step)
            writer.add_histogram(f"parameters/{name}", param.detach().float().cpu(), step)

    def _write_rates(self, writer: SummaryWriter, step: int) -> None:
        """examples/s, staleness and rows per step over the steps since the last summary."""
        now, record, window = time.perf_counter(), self._record, self._window
        if now > window.started:
            writer.add_scalar("examples_per_s", self._examples / (now - window.started), step)
        writer.add_scalar("staleness/last", record.staleness, step)
        pushes = record.pushes - window.pushes
        if pushes > 0:
            writer.add_scalar("staleness/mean", (record.staleness_sum - window.staleness_sum) / pushes, step)
        for table, rows in self._rows.items():
            writer.add_scalar(f"rows_per_step/{table}", rows / max(self._steps, 1), step)
        self._window = _Window(now, record.staleness_sum, record.pushes)
        self._examples = self._steps = 0
        self._rows = dict.fromkeys(self._rows, 0)


@dataclass(frozen=True)
class _Window:
    """Where the current summary interval started: time and the push record's counters."""

    started: float
    staleness_sum: int
    pushes: int


def event_writer(logdir: str) -> SummaryWriter:
    """A torch SummaryWriter writing event files into `logdir` (the chief's, an evaluator's)."""
    from torch.utils.tensorboard import SummaryWriter  # loads tensorboard: only with a logdir

    return SummaryWriter(log_dir=logdir)


def open_summaries(logdir: str, every: int, worker_index: int, record: Any) -> Summaries | None:
    """The chief's started Summaries when `logdir` is set; None on other workers or without one."""
    if not logdir or worker_index != 0:
        return None
    summaries = Summaries(logdir, every, record)
    summaries.start()
    return summaries
