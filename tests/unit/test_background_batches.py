"""Batches made in a background thread (data/background.py), and the Criteo reader's use of it."""

import threading
import time

import pytest

from paramserver.data import criteo
from paramserver.data.background import BackgroundBatches, BackgroundError

LINE = "1\t" + "\t".join(str(i) for i in range(13)) + "\t" + "\t".join(f"{i:08x}" for i in range(26)) + "\n"


def test_items_in_order_from_a_named_thread():
    seen = []

    def make():
        for i in range(10):
            seen.append(threading.current_thread().name)
            yield i

    assert list(BackgroundBatches(make, depth=2, name="parse-test")) == list(range(10))
    assert set(seen) == {"parse-test"}


def test_a_source_error_is_raised_in_the_loop_as_itself():
    def make():
        yield 1
        raise KeyError("bad line")

    got = []
    with pytest.raises(KeyError, match="bad line"):
        for item in BackgroundBatches(make):
            got.append(item)
    assert got == [1]


def test_the_queue_is_bounded_and_leaving_early_stops_the_thread():
    made = []
    closed = threading.Event()

    def make():
        try:
            for i in range(1000):
                made.append(i)
                yield i
        finally:
            closed.set()

    batches = BackgroundBatches(make, depth=3, name="parse-bounded")
    it = iter(batches)
    assert next(it) == 0
    time.sleep(0.1)
    assert len(made) <= 5  # the one taken, three queued, one waiting to be queued
    it.close()  # the loop left early
    assert closed.wait(2.0)
    assert not any(t.name == "parse-bounded" for t in threading.enumerate())
    with pytest.raises(BackgroundError):
        batches.start()


def test_no_batch_within_the_deadline():
    def make():
        time.sleep(0.3)  # longer than the deadline below
        yield 1

    with pytest.raises(BackgroundError, match="no batch in"):
        list(BackgroundBatches(make, timeout_s=0.1))


def test_criteo_parses_in_a_thread_by_default_and_inline_on_request():
    lines = [LINE] * 7
    threaded = list(criteo.batches(lines, 3))
    inline = list(criteo.batches(lines, 3, parse_ahead=0))
    assert [len(b[2]) for b in threaded] == [3, 3, 1]
    for a, b in zip(threaded, inline):
        for x, y in zip(a, b):
            assert x.equal(y)
