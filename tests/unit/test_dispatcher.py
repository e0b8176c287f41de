"""The data dispatcher (coordinator/dispatcher.py): order, holds, take-backs, checkpoints.

The seeded random tests drive workers through acquire / train / report / complete / release with
a counting model: every batch of every split adds to its own count when a worker trains it. With
no release each count must end at exactly 1; with releases at least 1, and above 1 only by the
batches a released worker trained after its last report. Each assertion names its seed.
"""

import copy
import json
import random
import threading
from collections import Counter
from dataclasses import dataclass

import pytest

from paramserver.base.errors import FailedPreconditionError, InvalidArgumentError
from paramserver.coordinator.dispatcher import Assignment, Dispatcher


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def described(num_splits=3, epochs=2, clock=None):
    dispatcher = Dispatcher(clock or Clock())
    dispatcher.describe(num_splits, epochs)
    return dispatcher


# ---- The description -------------------------------------------------------------------------


def test_the_first_description_decides_and_a_different_one_is_refused_naming_both():
    dispatcher = described(4, 2)
    dispatcher.describe(4, 2)  # every worker's script says the same: fine
    with pytest.raises(FailedPreconditionError, match=r"4 splits x 2 epochs.*5 splits x 2 epochs"):
        dispatcher.describe(5, 2)
    assert dispatcher.state()["num_splits"] == 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3", None, (1 << 20) + 1])
def test_bad_descriptions_are_refused(bad):
    dispatcher = Dispatcher()
    with pytest.raises(InvalidArgumentError, match="num_splits"):
        dispatcher.describe(bad, 1)
    with pytest.raises(InvalidArgumentError, match="epochs"):
        dispatcher.describe(3, bad)
    assert not dispatcher.described


def test_every_call_before_the_description_fails():
    dispatcher = Dispatcher()
    for call in (
        lambda: dispatcher.acquire(0),
        lambda: dispatcher.report(0, 0, 0, 1),
        lambda: dispatcher.complete(0, 0, 0, 1),
        dispatcher.state,
    ):
        with pytest.raises(FailedPreconditionError, match="not described"):
            call()
    assert dispatcher.release(0) == [] and not dispatcher.finished and not dispatcher.pending


# ---- Order, holds and take-backs -------------------------------------------------------------


def test_splits_go_out_in_epoch_then_split_order_and_taken_back_ones_first():
    dispatcher = described(2, 2)
    assert dispatcher.acquire(0) == Assignment(0, 0, 0)
    assert dispatcher.acquire(1) == Assignment(0, 1, 0)
    dispatcher.report(1, 0, 1, 3)
    dispatcher.complete(0, 0, 0, 5)
    assert dispatcher.acquire(0) == Assignment(1, 0, 0)  # no barrier between epochs
    assert dispatcher.release(1) == [Assignment(0, 1, 3)]
    assert dispatcher.acquire(2) == Assignment(0, 1, 3)  # epoch 0's split before epoch 1's new one
    assert dispatcher.acquire(3) == Assignment(1, 1, 0)
    assert dispatcher.acquire(4) is None and dispatcher.pending and not dispatcher.finished
    for worker, (epoch, split) in ((2, (0, 1)), (0, (1, 0)), (3, (1, 1))):
        dispatcher.complete(worker, epoch, split, 5)
    assert dispatcher.acquire(4) is None and dispatcher.finished and not dispatcher.pending
    assert dispatcher.progress()["batches_done"] == 20


def test_the_oldest_taken_back_split_goes_out_first():
    dispatcher = described(3, 2)
    for worker in range(6):
        dispatcher.acquire(worker)
    dispatcher.report(5, 1, 2, 4)
    dispatcher.report(1, 0, 1, 2)
    for worker in (5, 3, 1):
        dispatcher.release(worker)
    got = [dispatcher.acquire(worker) for worker in (7, 8, 9)]
    assert got == [Assignment(0, 1, 2), Assignment(1, 0, 0), Assignment(1, 2, 4)]


def test_acquire_while_holding_gives_the_same_split_at_its_last_reported_position():
    dispatcher = described()
    first = dispatcher.acquire(0)
    dispatcher.report(0, first.epoch, first.split, 7)
    assert dispatcher.acquire(0) == Assignment(first.epoch, first.split, 7)
    assert dispatcher.holding(0) == Assignment(first.epoch, first.split, 7)
    assert dispatcher.acquire(1) == Assignment(0, 1, 0)  # the retried call took nothing new


def test_reports_must_name_the_held_split_and_never_go_back():
    dispatcher = described()
    dispatcher.acquire(0)
    dispatcher.report(0, 0, 0, 4)
    dispatcher.report(0, 0, 0, 4)  # the same position again: fine
    with pytest.raises(InvalidArgumentError, match="position 3 of split 0 of epoch 0 goes back from 4"):
        dispatcher.report(0, 0, 0, 3)
    with pytest.raises(InvalidArgumentError, match="goes back"):
        dispatcher.complete(0, 0, 0, 2)
    with pytest.raises(FailedPreconditionError, match="worker 0 does not hold split 1 of epoch 0"):
        dispatcher.report(0, 0, 1, 5)
    with pytest.raises(FailedPreconditionError, match="holds no split"):
        dispatcher.report(1, 0, 0, 5)
    assert dispatcher.holding(0) == Assignment(0, 0, 4)  # nothing refused changed anything


def test_a_released_worker_can_no_longer_report_its_split():
    dispatcher = described()
    dispatcher.acquire(0)
    dispatcher.report(0, 0, 0, 2)
    assert dispatcher.release(0) == [Assignment(0, 0, 2)]
    assert dispatcher.release(0) == []
    with pytest.raises(FailedPreconditionError, match="taken back"):
        dispatcher.report(0, 0, 0, 3)
    with pytest.raises(FailedPreconditionError):
        dispatcher.complete(0, 0, 0, 9)
    assert dispatcher.acquire(1) == Assignment(0, 0, 2)


def test_a_retried_completion_and_a_late_report_of_the_completed_split_change_nothing():
    dispatcher = described()
    dispatcher.acquire(0)
    dispatcher.complete(0, 0, 0, 6)
    dispatcher.complete(0, 0, 0, 6)
    dispatcher.report(0, 0, 0, 4)
    assert dispatcher.holding(0) is None and dispatcher.progress()["batches_done"] == 6
    assert dispatcher.acquire(0) == Assignment(0, 1, 0)
    dispatcher.report(0, 0, 0, 6)  # a heartbeat that raced the completion, after the next acquire
    assert dispatcher.holding(0) == Assignment(0, 1, 0)


@pytest.mark.parametrize("field", ["worker", "epoch", "split", "position"])
@pytest.mark.parametrize("bad", [-1, 1.0, True, "1", None, 1 << 63])
def test_bad_numbers_in_calls_are_refused_naming_them(field, bad):
    dispatcher = described()
    dispatcher.acquire(0)
    arguments = {"worker": 0, "epoch": 0, "split": 0, "position": 1} | {field: bad}
    for call in (dispatcher.report, dispatcher.complete):
        with pytest.raises(InvalidArgumentError, match=field):
            call(**arguments)
    assert dispatcher.holding(0) == Assignment(0, 0, 0)


def test_progress_tells_the_epoch_under_way_what_is_done_in_flight_and_taken_back():
    clock = Clock()
    dispatcher = described(3, 2, clock)
    for worker in range(3):
        dispatcher.acquire(worker)
    dispatcher.complete(1, 0, 1, 4)
    clock.now = 2.5
    dispatcher.report(0, 0, 0, 2)
    dispatcher.release(2)
    clock.now = 3.0
    progress = dispatcher.progress()
    assert json.loads(json.dumps(progress)) == progress
    assert progress == {
        "num_splits": 3,
        "epochs": 2,
        "epoch": 0,
        "splits_done_in_epoch": 1,
        "splits_done": 1,
        "splits_total": 6,
        "batches_done": 4,
        "in_flight": [{"worker": 0, "epoch": 0, "split": 0, "position": 2, "since_report_s": 0.5}],
        "taken_back": [{"epoch": 0, "split": 2, "position": 0}],
    }


def test_concurrent_workers_get_every_split_exactly_once():
    dispatcher = described(200, 3)
    got: list[tuple[int, int]] = []
    lock = threading.Lock()

    def work(worker):
        while (assignment := dispatcher.acquire(worker)) is not None:
            with lock:
                got.append((assignment.epoch, assignment.split))
            dispatcher.report(worker, assignment.epoch, assignment.split, 1)
            dispatcher.complete(worker, assignment.epoch, assignment.split, 2)

    threads = [threading.Thread(target=work, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(got) == [(epoch, split) for epoch in range(3) for split in range(200)]
    assert dispatcher.finished and dispatcher.progress()["batches_done"] == 1200


# ---- The counting model ------------------------------------------------------------------------


@dataclass
class Worker:
    holding: Assignment | None = None
    trained: int = 0  # batches of the held split trained
    reported: int = 0


class Run:
    """Workers driven at random against a dispatcher; `counts` counts each batch trained."""

    def __init__(self, dispatcher, seed, lengths, workers, release_rate=0.0, counts=None):
        self.dispatcher, self.seed, self.rng = dispatcher, seed, random.Random(seed)
        self.lengths = lengths  # (epoch, split) -> batches
        self.workers = {worker: Worker() for worker in workers}
        self.release_rate = release_rate
        self.counts = Counter() if counts is None else counts
        self.repeats_allowed = Counter()  # batch -> times it may be trained again (after a release)
        state = dispatcher.state()  # what the dispatcher hands out next: new splits, and taken back first
        self.next_new = state["next_epoch"] * state["num_splits"] + state["next_split"]
        self.taken_back = {(e["epoch"], e["split"]): e["position"] for e in state["taken_back"] + state["in_flight"]}
        self.num_splits = state["num_splits"]

    def step(self):
        worker = self.rng.choice(sorted(self.workers))
        state = self.workers[worker]
        if state.holding is None:
            return self.acquire(worker, state)
        assignment, length = state.holding, self.lengths[state.holding.epoch, state.holding.split]
        key = (assignment.epoch, assignment.split)
        choice = self.rng.random()
        if choice < self.release_rate:
            assert self.dispatcher.release(worker) == [Assignment(*key, state.reported)], self.seed
            for batch in range(state.reported, state.trained):
                self.repeats_allowed[(*key, batch)] += 1
            self.taken_back[key] = state.reported
            self.workers[worker] = Worker()
        elif state.trained < length and choice < 0.75:
            self.counts[(*key, state.trained)] += 1
            state.trained += 1
        elif state.trained < length:
            self.dispatcher.report(worker, *key, state.trained)
            state.reported = state.trained
        else:
            self.dispatcher.complete(worker, *key, length)
            self.workers[worker] = Worker()

    def acquire(self, worker, state):
        assignment = self.dispatcher.acquire(worker)
        if assignment is None:
            assert self.dispatcher.finished or self.dispatcher.pending, self.seed
            return
        key = (assignment.epoch, assignment.split)
        if self.taken_back:
            oldest = min(self.taken_back)
            assert (key, assignment.position) == (oldest, self.taken_back.pop(oldest)), f"seed {self.seed}"
        else:
            assert key == divmod(self.next_new, self.num_splits) and assignment.position == 0, f"seed {self.seed}"
            self.next_new += 1
        state.holding, state.trained, state.reported = assignment, assignment.position, assignment.position

    def cut(self):
        """A checkpoint's cut: every worker reports its exact position."""
        for worker, state in self.workers.items():
            if state.holding is not None:
                self.dispatcher.report(worker, state.holding.epoch, state.holding.split, state.trained)
                state.reported = state.trained

    def finish(self, max_steps=200_000):
        for _ in range(max_steps):
            if self.dispatcher.finished:
                return
            self.step()
        raise AssertionError(f"seed {self.seed}: not finished after {max_steps} steps")

    def check(self, exactly_once):
        everything = {(e, s, b) for (e, s), length in self.lengths.items() for b in range(length)}
        assert set(self.counts) == everything, f"seed {self.seed}: batches missing or unknown"
        for batch, count in self.counts.items():
            if exactly_once:
                assert count == 1, f"seed {self.seed}: batch {batch} trained {count} times"
            else:
                assert 1 <= count <= 1 + self.repeats_allowed[batch], f"seed {self.seed}: batch {batch} x{count}"
        assert self.dispatcher.progress()["batches_done"] == sum(self.lengths.values()), self.seed


def random_data(rng):
    num_splits, epochs = rng.randint(1, 7), rng.randint(1, 3)
    lengths = {(e, s): rng.randint(0, 6) for e in range(epochs) for s in range(num_splits)}
    dispatcher = Dispatcher(Clock())
    dispatcher.describe(num_splits, epochs)
    return dispatcher, lengths


@pytest.mark.parametrize("seed", range(40))
def test_with_no_release_every_batch_is_trained_exactly_once(seed):
    dispatcher, lengths = random_data(random.Random(seed))
    run = Run(dispatcher, seed, lengths, workers=range(random.Random(seed).randint(1, 5)))
    run.finish()
    run.check(exactly_once=True)


@pytest.mark.parametrize("seed", range(40))
def test_with_releases_every_batch_is_trained_at_least_once_and_repeats_are_bounded(seed):
    dispatcher, lengths = random_data(random.Random(seed))
    run = Run(dispatcher, seed, lengths, workers=range(4), release_rate=0.05)
    run.finish()
    run.check(exactly_once=False)


@pytest.mark.parametrize("seed", range(30))
def test_a_run_restored_mid_way_onto_other_workers_ends_with_the_same_counts(seed):
    rng = random.Random(seed)
    dispatcher, lengths = random_data(rng)
    run = Run(dispatcher, seed, lengths, workers=range(3))
    for _ in range(rng.randint(0, 60)):
        if not dispatcher.finished:
            run.step()
    run.cut()
    saved, counts_at_cut = json.loads(json.dumps(dispatcher.state())), Counter(run.counts)
    run.finish()
    run.check(exactly_once=True)

    restored = Dispatcher.from_state(copy.deepcopy(saved), clock=Clock())
    assert restored.state()["in_flight"] == [], seed  # what was in flight is taken back
    again = Run(restored, seed + 1000, lengths, workers=range(10, 10 + rng.randint(1, 6)), counts=counts_at_cut)
    again.finish()
    again.check(exactly_once=True)
    assert again.counts == run.counts, f"seed {seed}"


# ---- Checkpoint records from disk: everything checked ----------------------------------------


def mid_run_state():
    dispatcher = described(4, 3)
    for worker in range(5):
        dispatcher.acquire(worker)
    dispatcher.report(2, 0, 2, 7)
    dispatcher.release(2)
    dispatcher.report(4, 1, 0, 3)
    dispatcher.complete(0, 0, 0, 9)
    return dispatcher.state()


def test_the_record_says_what_is_done_in_flight_and_taken_back():
    assert mid_run_state() == {
        "version": 1,
        "num_splits": 4,
        "epochs": 3,
        "next_epoch": 1,
        "next_split": 1,
        "in_flight": [
            {"worker": 1, "epoch": 0, "split": 1, "position": 0},
            {"worker": 3, "epoch": 0, "split": 3, "position": 0},
            {"worker": 4, "epoch": 1, "split": 0, "position": 3},
        ],
        "taken_back": [{"epoch": 0, "split": 2, "position": 7}],
        "batches_done": 9,
    }


def test_a_restored_dispatcher_hands_out_what_was_in_flight_at_its_positions_first():
    restored = Dispatcher.from_state(mid_run_state())
    got = [restored.acquire(worker) for worker in range(5)]
    assert got == [
        Assignment(0, 1, 0),
        Assignment(0, 2, 7),
        Assignment(0, 3, 0),
        Assignment(1, 0, 3),
        Assignment(1, 1, 0),
    ]


def _set(path, value):
    def change(state):
        target = state
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return change


def _delete(path):
    def change(state):
        target = state
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return change


def _append(field, entry):
    return lambda state: state[field].append(entry)


BAD_STATES = [
    (_set(["version"], 2), "version"),
    (_set(["num_splits"], 0), "num_splits"),
    (_set(["num_splits"], "4"), "num_splits"),
    (_set(["epochs"], -1), "epochs"),
    (_set(["epochs"], 2.0), "epochs"),
    (_set(["next_epoch"], 4), "next_epoch"),
    (_set(["next_split"], 4), "next_split"),
    (lambda s: s.update(next_epoch=3, next_split=1), "next_split"),
    (_set(["batches_done"], -5), "batches_done"),
    (_set(["batches_done"], None), "batches_done"),
    (_set(["in_flight"], {}), "in_flight must be a list"),
    (_set(["taken_back"], "none"), "taken_back must be a list"),
    (_set(["in_flight", 0, "position"], -1), r"in_flight\[0\].position"),
    (_set(["in_flight", 1, "worker"], True), r"in_flight\[1\].worker"),
    (_set(["in_flight", 2, "split"], 4), r"in_flight\[2\].split"),
    (_set(["in_flight", 2, "epoch"], 3), r"in_flight\[2\].epoch"),
    (_set(["taken_back", 0, "position"], 1 << 63), r"taken_back\[0\].position"),
    (_set(["taken_back", 0], [0, 2, 7]), r"taken_back\[0\] must be a JSON object"),
    (_set(["in_flight", 2, "split"], 1), r"in_flight\[2\]: split 1 of epoch 1 was never handed out"),
    (_set(["taken_back", 0, "split"], 1), r"taken_back\[0\]: split 1 of epoch 0 appears twice"),
    (_append("taken_back", {"epoch": 0, "split": 2, "position": 1}), r"taken_back\[1\].*appears twice"),
    (_set(["in_flight", 1, "worker"], 1), r"in_flight\[1\]: worker 1 holds two splits"),
    (_append("taken_back", {"epoch": 0, "split": 0, "position": 0}), None),  # a done split: allowed back
    (_delete(["in_flight", 0, "worker"]), r"in_flight\[0\]: missing keys \['worker'\]"),
    (_set(["in_flight", 0, "extra"], 1), r"unknown keys \['extra'\]"),
    (_delete(["next_split"]), r"missing keys \['next_split'\]"),
    (_set(["colour"], "red"), r"unknown keys \['colour'\]"),
    (lambda s: s["taken_back"].extend([{"epoch": 0, "split": 0, "position": 0}] * 10), "only 5 were handed out"),
]


@pytest.mark.parametrize("change, fragment", BAD_STATES)
def test_bad_records_are_refused_naming_the_field_and_change_nothing(change, fragment):
    dispatcher = described(2, 1)
    dispatcher.acquire(0)
    before = dispatcher.state()
    state = mid_run_state()
    change(state)
    if fragment is None:  # not every change is bad: the test must tell them apart
        Dispatcher.from_state(state)
        return
    with pytest.raises(InvalidArgumentError, match=fragment):
        dispatcher.load_state(state)
    assert dispatcher.state() == before and dispatcher.holding(0) == Assignment(0, 0, 0)


@pytest.mark.parametrize("record", [None, [], "state", 3])
def test_a_record_that_is_not_an_object_is_refused(record):
    with pytest.raises(InvalidArgumentError, match="must be a JSON object"):
        Dispatcher.from_state(record)
