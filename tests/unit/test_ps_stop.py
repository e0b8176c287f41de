"""node/ps_stop.py: a PS of a run that ends it, with checkpoints, serves on after its first signal for the
workers' preemption checkpoint, until a Shutdown, a second signal or the grace; elsewhere a signal stops it."""

import signal
import time

import pytest

from paramserver.base.config import Options
from paramserver.node.ps_stop import StopRequests, preemption_grace

TERM, INT = int(signal.SIGTERM), int(signal.SIGINT)


@pytest.mark.parametrize(
    ("options", "grace"),
    [
        ({"checkpoint_dir": "/c", "stop_ps_at_end": True, "preempt_grace_s": 7.0}, 7.0),
        ({"checkpoint_dir": "/c"}, None),  # the launcher stops its PS after the workers: at once
        ({"stop_ps_at_end": True}, None),  # no checkpoint to wait for
    ],
)
def test_only_a_ps_that_the_run_ends_and_that_checkpoints_waits_after_a_signal(options, grace):
    assert preemption_grace(Options.from_dict(options)) == grace


def test_without_a_grace_a_signal_stops_at_once():
    requests = StopRequests(0, None)
    requests.signalled(TERM)
    assert requests.wait(0.0) and requests.causes == [TERM]


def test_the_first_signal_serves_on_until_the_grace_is_over():
    requests = StopRequests(0, 0.3)
    requests.signalled(TERM)
    started = time.monotonic()
    assert not requests.wait(0.05)  # still serving
    while not requests.wait(1.0):  # the wait ends at the grace's end, not after its whole timeout
        assert time.monotonic() - started < 2.0
    assert 0.25 <= time.monotonic() - started < 1.0
    assert requests.causes == [TERM]


@pytest.mark.parametrize("second", [TERM, INT])
def test_a_second_signal_stops_at_once(second):
    requests = StopRequests(0, 60.0)
    requests.signalled(TERM)
    requests.signalled(second)
    assert requests.wait(0.0) and requests.causes == [TERM, second]


def test_the_chiefs_shutdown_during_the_grace_stops_with_the_signal_first():
    requests = StopRequests(0, 60.0)
    requests.signalled(INT)
    requests.stop("end")
    assert requests.wait(0.0) and requests.causes == [INT, "end"]  # the exit code counts the signal first


def test_nothing_asked_nothing_stops():
    requests = StopRequests(0, 60.0)
    assert not requests.wait(0.01) and requests.causes == []
