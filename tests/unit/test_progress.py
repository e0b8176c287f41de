"""The progress channel: what a worker writes and how the launcher turns it into examples/s."""

import json
import os
import time

from paramserver.worker.progress import ProgressBoard, ProgressWriter


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
    progress = [r for r in records if "steps" in r]
    assert progress[-1]["examples"] == 1024
    assert progress[-1]["t"] <= last_step
    assert {"worker": 0, "result": {"auc": 0.8}} in records


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


def test_done_sends_the_final_counts_then_one_done_line_even_when_closed_after():
    read_fd, write_fd = os.pipe()
    writer = ProgressWriter(write_fd, worker=1, interval=60.0)  # no periodic line: only done() writes counts
    writer.update(steps=3, examples=24)
    writer.done()
    writer.done()
    writer.close()
    records = _lines(read_fd)
    assert [r for r in records if r.get("done")] == [{"worker": 1, "done": True}]
    assert records[-1] == {"worker": 1, "done": True}
    assert records[-2]["steps"] == 3 and records[-2]["examples"] == 24


def test_close_sends_the_done_line_unless_told_the_script_did_not_finish():
    sent, held = os.pipe(), os.pipe()
    ProgressWriter(sent[1], worker=0).close()
    ProgressWriter(held[1], worker=0).close(done=False)
    assert _lines(sent[0])[-1] == {"worker": 0, "done": True}
    assert not any(r.get("done") for r in _lines(held[0]))


def test_the_board_records_done_workers_until_they_restart():
    board = ProgressBoard()
    board.feed(json.dumps({"worker": 1, "done": True}))
    assert board.is_done(1) and not board.is_done(0)
    board.restart(1)
    assert not board.is_done(1)
    board.feed(json.dumps({"worker": 0, "done": True}))
    board.restart()
    assert not board.is_done(0)


def test_a_frozen_board_ignores_the_lines_fed_after_the_freeze():
    board = ProgressBoard()
    board.feed(json.dumps({"worker": 0, "steps": 10, "examples": 80, "t": 100.0}))
    board.feed(json.dumps({"worker": 1, "steps": 5, "examples": 40, "t": 100.0}))
    at_interrupt = board.freeze()
    board.feed(json.dumps({"worker": 0, "steps": 900, "examples": 7200, "t": 105.0}))  # steps while stopping
    board.feed(json.dumps({"worker": 2, "steps": 1, "examples": 8, "t": 105.0}))
    board.feed(json.dumps({"worker": 0, "result": {"auc": 0.5}}))
    board.feed(json.dumps({"worker": 0, "done": True}))
    assert at_interrupt["steps"] == 15 and at_interrupt["examples"] == 120
    assert board.totals()["steps"] == 15 and board.totals()["examples"] == 120
    assert board.results == {}
    assert board.is_done(0)


def _feed(board: ProgressBoard, worker: int, **record) -> None:
    board.feed(json.dumps({"worker": worker, "t": time.time(), **record}))


def test_a_roll_back_counts_the_steps_trained_not_those_redone_and_every_checkpoint_of_the_run():
    board = ProgressBoard()
    _feed(board, 0, steps=10, examples=80)
    _feed(board, 1, steps=8, examples=64)
    _feed(board, 0, result={"checkpoints_written": 1, "checkpoints_failed": 0})  # both paused at it
    _feed(board, 0, steps=15, examples=120)
    _feed(board, 1, steps=12, examples=96)
    board.restart()  # back to the checkpoint: 9 steps are trained again
    assert board.totals()["steps"] == 18 and board.totals()["examples"] == 144
    assert board.steps_redone == 9
    _feed(board, 0, steps=3, examples=24)
    _feed(board, 1, steps=2, examples=16)
    _feed(board, 0, result={"checkpoints_written": 1, "checkpoints_failed": 1})  # the restarted chief's own counts
    assert board.totals()["steps"] == 23
    assert board.steps_by_worker() == {0: 13, 1: 10}
    assert board.results[0] == {"checkpoints_written": 2, "checkpoints_failed": 1}


def test_a_worker_restarted_alone_keeps_its_steps():
    board = ProgressBoard()
    _feed(board, 0, steps=10, examples=80)
    _feed(board, 1, steps=8, examples=64)
    board.restart(1)
    _feed(board, 1, steps=2, examples=16)
    assert board.totals()["steps"] == 20 and board.steps_redone == 0
    assert board.steps_by_worker() == {0: 10, 1: 10}
