"""The progress channel: what a worker writes and how the launcher turns it into examples/s."""

import json
import os
import time

from paramserver.progress import ProgressBoard, ProgressWriter


def _lines(fd: int) -> list[dict]:
    with os.fdopen(fd) as reader:
        return [json.loads(line) for line in reader]


def test_a_line_written_after_training_carries_the_time_of_the_last_step():
    read_fd, write_fd = os.pipe()
    writer = ProgressWriter(write_fd, worker=0, interval=0.0)
    writer.update(steps=1, examples=512)
    writer.update(steps=1, examples=512)
    last_step = time.time()
    time.sleep(0.05)  # an evaluation after training
    writer.result({"auc": 0.8})
    writer.close()
    records = _lines(read_fd)
    progress = [r for r in records if "result" not in r]
    assert progress[-1]["examples"] == 1024
    assert progress[-1]["t"] <= last_step
    assert records[-1] == {"worker": 0, "result": {"auc": 0.8}}


def test_examples_per_s_counts_the_examples_after_the_first_line_over_the_time_since_it():
    board = ProgressBoard()
    board.feed(json.dumps({"worker": 0, "steps": 1, "examples": 512, "t": 100.0}))
    board.feed(json.dumps({"worker": 1, "steps": 1, "examples": 512, "t": 100.5}))
    board.feed(json.dumps({"worker": 0, "steps": 5, "examples": 2560, "t": 102.0}))
    board.feed(json.dumps({"worker": 1, "steps": 4, "examples": 2048, "t": 101.5}))
    totals = board.totals()
    assert totals["examples"] == 4608
    # 4608 examples, of which worker 0's first 512 were done before the clock started, in 2 s
    assert totals["examples_per_s"] == (4608 - 512) / 2.0


def test_a_malformed_line_is_ignored():
    board = ProgressBoard()
    board.feed("not json")
    board.feed(json.dumps({"steps": 3}))
    assert board.totals()["examples"] == 0
