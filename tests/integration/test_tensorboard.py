"""`--logdir`: the chief of a real `paramserver run` writes TensorBoard event files that
TensorBoard's own reader reads: scalars (loss, examples/s, staleness, gradient norms, rows per
step) and histograms (gradients and parameters) on every `--summary-every` steps."""

import re
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tests.conftest import ROOT

pytestmark = pytest.mark.cluster  # a cluster of processes

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "train_summaries.py")
STEPS, EVERY = 12, 3
VARIABLES = {"opt0.out.weight": 8, "opt0.out.bias": 2}  # name on the PS -> elements


def run(procs, *flags: str) -> str:
    argv = [sys.executable, "-m", "paramserver", "run", "--ps", "2", "--workers", "2", "--progress-every", "0",
            *flags, SCRIPT, "--", "--steps", str(STEPS)]
    proc = procs.start(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert procs.leftovers() == []
    return out


def printed(out: str, what: str) -> dict[int, float]:
    """The chief's `<what> <step> <value>` lines (its launcher prefix is [worker0])."""
    return {int(step): float(value) for step, value in re.findall(rf"\[worker0\] {what} (\d+) (\S+)", out)}


def read_events(logdir) -> EventAccumulator:
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    events.Reload()
    return events


def test_the_chief_writes_scalars_and_histograms_tensorboard_reads(procs, tmp_path):
    logdir = tmp_path / "tb"
    out = run(procs, "--logdir", str(logdir), "--summary-every", str(EVERY))
    files = list(logdir.iterdir())
    assert len(files) == 1 and files[0].name.startswith("events.out.tfevents"), files  # the chief's only
    events = read_events(logdir)
    tags = events.Tags()
    summary_steps = list(range(EVERY, STEPS + 1, EVERY))

    losses = printed(out, "loss")
    assert sorted(losses) == list(range(1, STEPS + 1))
    written = {e.step: e.value for e in events.Scalars("loss")}
    assert sorted(written) == summary_steps
    for step, value in written.items():
        assert value == pytest.approx(losses[step], rel=1e-6)  # stored as float32

    rows = printed(out, "rows")
    per_step = {e.step: e.value for e in events.Scalars("rows_per_step/ids")}
    for step in summary_steps:  # the mean over the steps since the previous summary
        assert per_step[step] == pytest.approx(sum(rows[s] for s in range(step - EVERY + 1, step + 1)) / EVERY)

    for tag in ("examples_per_s", "staleness/last", "staleness/mean"):
        values = events.Scalars(tag)
        assert [e.step for e in values] == summary_steps, tag
        assert all(e.value >= 0 for e in values), tag
    assert all(e.value > 0 for e in events.Scalars("examples_per_s"))
    assert [(e.step, e.value) for e in events.Scalars("eval/score")] == [(1000, 0.75)]

    for name, elements in VARIABLES.items():
        norms = events.Scalars(f"gradient_norm/{name}")
        assert [e.step for e in norms] == summary_steps and all(e.value > 0 for e in norms)
        for kind in ("gradients", "parameters"):
            histograms = events.Histograms(f"{kind}/{name}")
            assert [h.step for h in histograms] == summary_steps, (kind, name)
            assert all(h.histogram_value.num == elements for h in histograms), (kind, name)
    parameters = events.Histograms("parameters/opt0.out.weight")
    assert parameters[0].histogram_value.sum != parameters[-1].histogram_value.sum  # they trained
    assert set(tags["histograms"]) == {f"{kind}/{name}" for kind in ("gradients", "parameters") for name in VARIABLES}


def test_no_event_files_without_a_logdir(procs, tmp_path):
    out = run(procs, "--summary-every", "1")
    assert printed(out, "loss")
    assert not list(ROOT.glob("runs")) and not list(tmp_path.iterdir())
