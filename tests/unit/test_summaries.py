"""worker/summaries.py on its own: the lifecycle (no thread left after stop, nothing written after
it), summaries only on due steps, and nothing at all off the chief or without a logdir."""

import threading

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from paramserver.client.ps_client import PushRecord
from paramserver.worker.summaries import Summaries, open_summaries


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_summaries_on_due_steps_only_and_nothing_after_stop(tmp_path):
    before = set(threading.enumerate())
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([3.0, 4.0, 0.0])
    with Summaries(str(tmp_path), 2, PushRecord()) as summaries:
        for step in range(1, 5):
            summaries.note_rows("t", step)
            summaries.on_step(step, [("w", param)])
            summaries.report(examples=8, loss=float(step))
            summaries.report(loss=100.0)  # a second report of the same step is not a second loss
    summaries.on_step(6, [("w", param)])
    summaries.report(loss=6.0)
    summaries.log_scalar("late", 1.0)
    assert set(threading.enumerate()) <= before  # the writer's thread was joined
    written = scalars(tmp_path)
    assert written["loss"] == [(2, 2.0), (4, 4.0)]
    assert written["gradient_norm/w"] == [(2, 5.0), (4, 5.0)]
    assert written["rows_per_step/t"] == [(2, 1.5), (4, 3.5)]
    assert "late" not in written


def test_no_summaries_off_the_chief_or_without_a_logdir(tmp_path):
    assert open_summaries("", 1, 0, PushRecord()) is None
    assert open_summaries(str(tmp_path), 1, 1, PushRecord()) is None
    assert list(tmp_path.iterdir()) == []
