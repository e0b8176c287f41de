"""The coordinator hands out the data (Coordinator.split, coordinator/membership.py; the Split call):
the first call describes it, positions arrive with heartbeats, barriers and the leave, a worker that
leaves or dies has its split taken back at its last position, and a chief that resumes holds the
splits until it restored a checkpoint's positions.

A fake clock decides who is dead and every wait is 0 s, so no verdict depends on this machine's speed.
"""

import threading

import pytest
from tests.wait import finished

from paramserver.base.errors import FailedPreconditionError, InvalidArgumentError, MalformedFrameError
from paramserver.coordinator.coordinator_service import CoordinatorService
from paramserver.coordinator.dispatcher import Dispatcher
from paramserver.coordinator.membership import Coordinator
from paramserver.wire import codec
from paramserver.wire import messages as msg

SPLITS, EPOCHS = 4, 2


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(workers=2, timeout=10.0, elastic=False):
    clock = Clock()
    coordinator = Coordinator(workers, heartbeat_timeout_s=timeout, clock=clock, elastic=elastic)
    for worker in range(workers):
        coordinator.join(worker)
    return coordinator, clock


def given(coordinator, worker, done=None):
    """The split handed to `worker` after `done` (a list [epoch, split, position]), or None."""
    return coordinator.split(worker, SPLITS, EPOCHS, done).get("split")


def in_flight(coordinator) -> dict[int, tuple[int, int, int]]:
    state = coordinator.data_state()
    return {e["worker"]: (e["epoch"], e["split"], e["position"]) for e in state["in_flight"]}


def taken_back(coordinator) -> list[tuple[int, int, int]]:
    return [(e["epoch"], e["split"], e["position"]) for e in coordinator.data_state()["taken_back"]]


# ---- describe, hand out, complete ------------------------------------------------------------
def test_the_first_call_describes_the_data_and_splits_go_out_in_order():
    coordinator, _ = make()
    assert coordinator.data_state() is None  # nothing described: a checkpoint records no data
    assert given(coordinator, 0) == [0, 0, 0]
    assert given(coordinator, 1) == [0, 1, 0]
    state = coordinator.data_state()
    assert (state["num_splits"], state["epochs"], state["next_epoch"], state["next_split"]) == (SPLITS, EPOCHS, 0, 2)
    assert given(coordinator, 0) == [0, 0, 0]  # a retried call: the split it holds, again


def test_another_description_is_refused_naming_both_and_hands_out_nothing():
    coordinator, _ = make()
    given(coordinator, 0)
    before = coordinator.data_state()
    with pytest.raises(FailedPreconditionError, match=r"4 splits x 2 epochs.*5 splits x 2 epochs"):
        coordinator.split(1, 5, EPOCHS)
    with pytest.raises(FailedPreconditionError, match=r"4 splits x 2 epochs.*4 splits x 3 epochs"):
        coordinator.split(1, SPLITS, 3)
    assert coordinator.data_state() == before and coordinator.dispatcher.holding(1) is None


def test_done_completes_the_split_and_a_retried_completion_changes_nothing():
    coordinator, _ = make()
    given(coordinator, 0)
    assert given(coordinator, 0, done=[0, 0, 5]) == [0, 1, 0]
    assert given(coordinator, 0, done=[0, 0, 5]) == [0, 1, 0]  # the reply was lost: the same answer
    progress = coordinator.dispatcher.progress()
    assert (progress["splits_done"], progress["batches_done"]) == (1, 5)


def test_every_split_goes_out_once_per_epoch_then_the_data_is_done():
    coordinator, _ = make(workers=1)
    handed, done = [], None
    while (split := given(coordinator, 0, done)) is not None:
        handed.append(tuple(split))
        done = [split[0], split[1], 3]
    assert handed == [(epoch, split, 0) for epoch in range(EPOCHS) for split in range(SPLITS)]
    view = coordinator.split(0, SPLITS, EPOCHS, None)
    assert view.get("split") is None and view["data_done"] is True
    assert coordinator.dispatcher.progress()["batches_done"] == 3 * SPLITS * EPOCHS


def all_but_the_last_done() -> Coordinator:
    """Worker 0 trained every split but the last; worker 1 holds that one."""
    coordinator, _ = make()
    dispatcher = coordinator.dispatcher
    dispatcher.describe(SPLITS, EPOCHS)
    for _ in range(SPLITS * EPOCHS - 1):
        assigned = dispatcher.acquire(0)
        dispatcher.complete(0, assigned.epoch, assigned.split, 2)
    assert given(coordinator, 1) == [EPOCHS - 1, SPLITS - 1, 0]
    return coordinator


def test_a_worker_with_no_split_left_hears_not_yet_while_another_holds_the_last():
    coordinator = all_but_the_last_done()
    view = coordinator.split(0, SPLITS, EPOCHS, None, wait_s=0)
    assert view.get("split") is None and view["data_done"] is False


def test_a_waiting_worker_gets_the_split_another_gives_back():
    coordinator = all_but_the_last_done()
    answer = {}
    waiter = threading.Thread(target=lambda: answer.update(coordinator.split(0, SPLITS, EPOCHS, None, wait_s=30)))
    waiter.start()  # it may ask before or after the leave: either way it gets that split
    coordinator.leave(1, (EPOCHS - 1, SPLITS - 1, 4))
    finished(waiter, "the waiting Split call to answer")
    assert answer["split"] == [EPOCHS - 1, SPLITS - 1, 4]


# ---- positions, leaves and deaths --------------------------------------------------------------
def test_a_worker_that_leaves_gives_its_split_back_at_the_position_it_leaves_with():
    coordinator, _ = make()
    given(coordinator, 0)
    assert given(coordinator, 1) == [0, 1, 0]
    coordinator.heartbeat(1, 3, position=(0, 1, 2))
    coordinator.leave(1, (0, 1, 6))
    assert taken_back(coordinator) == [(0, 1, 6)]
    assert given(coordinator, 0, done=[0, 0, 9]) == [0, 1, 6]  # taken back before any new split


def test_a_leave_with_no_position_gives_the_split_back_at_the_last_reported_one():
    coordinator, _ = make()
    given(coordinator, 0)
    given(coordinator, 1)
    coordinator.heartbeat(1, 3, position=(0, 1, 2))
    coordinator.leave(1)
    assert taken_back(coordinator) == [(0, 1, 2)]


def test_a_dead_worker_is_released_by_newly_gone_at_its_last_heartbeats_position():
    coordinator, clock = make()
    given(coordinator, 0)
    given(coordinator, 1)
    coordinator.heartbeat(1, 7, position=(0, 1, 4))
    clock.now = 5
    coordinator.heartbeat(0, 1, position=(0, 0, 1))
    assert coordinator.newly_gone() == [] and taken_back(coordinator) == []
    clock.now = 10.5  # worker 1 silent for longer than the heartbeat timeout
    assert [worker for worker, _ in coordinator.newly_gone()] == [1]
    assert taken_back(coordinator) == [(0, 1, 4)] and list(in_flight(coordinator)) == [0]
    assert coordinator.newly_gone() == []  # released once


def test_a_heartbeat_for_a_split_taken_back_says_split_lost_and_moves_nothing():
    coordinator, clock = make()
    given(coordinator, 0)
    given(coordinator, 1)
    coordinator.heartbeat(1, 7, position=(0, 1, 4))
    clock.now = 11
    coordinator.heartbeat(0, 2)
    coordinator.newly_gone()
    view = coordinator.heartbeat(1, 9, position=(0, 1, 8))  # it was only slow: it hears so
    assert view["split_lost"] is True
    assert coordinator.state(1) == "training"  # alive again, but without that split
    assert taken_back(coordinator) == [(0, 1, 4)] and coordinator.dispatcher.holding(1) is None
    assert "split_lost" not in coordinator.heartbeat(0, 3, position=(0, 0, 2))


def test_a_barrier_records_the_position_before_the_worker_arrives_and_says_split_lost():
    coordinator, clock = make()
    given(coordinator, 0)
    given(coordinator, 1)
    view = coordinator.barrier("checkpoint#1", 0, wait_s=0, training_only=True, position=(0, 0, 7))
    assert view["open"] is False and view["waiting"] == [1]
    assert in_flight(coordinator)[0] == (0, 0, 7)  # what the checkpoint at this cut records
    clock.now = 11
    coordinator.heartbeat(0, 1)
    coordinator.newly_gone()  # worker 1 is dead: its split goes back
    lost = coordinator.barrier("checkpoint#1", 1, wait_s=0, training_only=True, position=(0, 1, 3))
    assert lost["split_lost"] is True and lost["open"] is False


def test_a_completion_of_a_split_taken_back_meanwhile_goes_on_with_the_next_split():
    """A worker found dead while only slow finishes the split it was training: its Split call must not
    fail the script; the split went back, so the worker is handed the next one (here: that split again)."""
    coordinator, clock = make()
    given(coordinator, 0)
    given(coordinator, 1)
    coordinator.heartbeat(1, 1, position=(0, 1, 2))
    clock.now = 11
    coordinator.heartbeat(0, 1)
    assert [worker for worker, _ in coordinator.newly_gone()] == [1]
    assert given(coordinator, 1, done=[0, 1, 5]) == [0, 1, 2]
    with pytest.raises(FailedPreconditionError, match="does not hold split 0"):  # it holds one: a client's bug
        given(coordinator, 1, done=[0, 0, 5])


def test_a_late_heartbeat_with_an_older_position_does_not_fail():
    """The heartbeat thread read the position before the training thread's barrier reported a newer
    one, and its call arrived second: the coordinator keeps the newer position, the heartbeat counts."""
    coordinator, clock = make()
    given(coordinator, 0)
    coordinator.barrier("checkpoint#1", 0, wait_s=0, training_only=True, position=(0, 0, 7))
    clock.now = 3
    coordinator.heartbeat(0, 5, position=(0, 0, 6))
    assert in_flight(coordinator)[0] == (0, 0, 7) and coordinator.view()["steps"]["0"] == 5


# ---- a resumed run: hold_data, restore_data ------------------------------------------------------
def recorded() -> dict:
    """A checkpoint's record: epoch 0's splits 0 and 1 done, split 2 in flight at batch 3, 3 at batch 1."""
    dispatcher = Dispatcher()
    dispatcher.describe(SPLITS, EPOCHS)
    for worker in range(2):
        dispatcher.acquire(worker)
        dispatcher.complete(worker, 0, worker, 6)
    dispatcher.acquire(0)
    dispatcher.acquire(1)
    dispatcher.report(0, 0, 2, 3)
    dispatcher.report(1, 0, 3, 1)
    return dispatcher.state()


def test_held_data_answers_not_yet_until_restored_then_continues_the_checkpoints_positions():
    coordinator, _ = make()
    coordinator.hold_data()
    view = coordinator.split(1, SPLITS, EPOCHS, None, wait_s=0)
    assert view.get("split") is None and view["data_done"] is False
    assert coordinator.data_state() is None  # not even described: the checkpoint's record decides
    coordinator.restore_data(recorded())
    assert given(coordinator, 1) == [0, 2, 3]
    assert given(coordinator, 0) == [0, 3, 1]
    assert given(coordinator, 0, done=[0, 3, 6]) == [1, 0, 0]
    assert coordinator.dispatcher.progress()["batches_done"] == 12 + 6


def test_a_worker_waiting_for_held_data_is_answered_once_the_chief_restores_it():
    coordinator, _ = make()
    coordinator.hold_data()
    answer = {}
    waiter = threading.Thread(target=lambda: answer.update(coordinator.split(1, SPLITS, EPOCHS, None, wait_s=30)))
    waiter.start()
    coordinator.restore_data(None)  # a fresh start
    finished(waiter, "the held Split call to answer")
    assert answer["split"] == [0, 0, 0]


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda r: r.update(version=99), "version"),
        (lambda r: r.update(next_split=SPLITS), "next_split"),
        (lambda r: r["in_flight"][0].update(position=-1), r"in_flight\[0\]\.position"),
        (lambda r: r.update(taken_back="all"), "taken_back must be a list"),
        (lambda r: r.pop("epochs"), "epochs"),
    ],
    ids=["version", "next_split", "position", "taken_back", "missing"],
)
def test_a_bad_record_is_refused_naming_it_and_changes_nothing(change, fragment):
    coordinator, _ = make()
    coordinator.hold_data()
    record = recorded()
    change(record)
    with pytest.raises(InvalidArgumentError, match=fragment):
        coordinator.restore_data(record)
    assert coordinator.data_state() is None
    view = coordinator.split(1, SPLITS, EPOCHS, None, wait_s=0)  # still held: no split from a fresh start
    assert view.get("split") is None and view["data_done"] is False
    coordinator.restore_data(recorded())
    assert given(coordinator, 1) == [0, 2, 3]


def test_a_split_wait_out_of_range_is_refused_before_describing_anything():
    coordinator, _ = make()
    for wait in (-1, 61, float("nan")):
        with pytest.raises(InvalidArgumentError, match="split wait"):
            coordinator.split(0, SPLITS, EPOCHS, None, wait_s=wait)
    with pytest.raises(InvalidArgumentError, match="outside the cluster"):
        coordinator.split(2, SPLITS, EPOCHS)
    assert coordinator.data_state() is None


# ---- the Split call on the wire ------------------------------------------------------------------
def call(service, method, meta) -> msg.CoordinatorReply:
    return msg.CoordinatorReply.from_meta(codec.decode(service.call(method, codec.encode(meta))).meta)


def test_split_and_positions_round_trip_through_the_service_frames():
    coordinator, _ = make()
    service = CoordinatorService(coordinator)
    reply = call(service, "Split", {"worker": 1, "splits": SPLITS, "epochs": EPOCHS})
    assert reply.split == msg.DataPosition(0, 0, 0) and reply.data_done is None
    reply = call(service, "Heartbeat", {"worker": 1, "step": 2, "position": [0, 0, 2]})
    assert reply.split_lost is None and in_flight(coordinator)[1] == (0, 0, 2)
    call(service, "Barrier", {"worker": 1, "name": "b", "wait": 0, "position": [0, 0, 3]})
    assert in_flight(coordinator)[1] == (0, 0, 3)
    reply = call(service, "Split", {"worker": 1, "splits": SPLITS, "epochs": EPOCHS, "done": [0, 0, 4]})
    assert reply.split == msg.DataPosition(0, 1, 0)
    call(service, "Leave", {"worker": 1, "position": [0, 1, 2]})
    assert taken_back(coordinator) == [(0, 1, 2)]
    reply = call(service, "Split", {"worker": 0, "splits": SPLITS, "epochs": EPOCHS, "wait": 0.0})
    assert reply.split == msg.DataPosition(0, 1, 2)


def test_a_split_request_on_held_data_says_not_yet_on_the_wire():
    coordinator, _ = make()
    coordinator.hold_data()
    reply = call(CoordinatorService(coordinator), "Split", {"worker": 0, "splits": SPLITS, "epochs": EPOCHS})
    assert reply.split is None and reply.data_done is False


@pytest.mark.parametrize(
    "method, meta, field",
    [
        ("Split", {"worker": 0, "epochs": 1}, "splits"),
        ("Split", {"worker": 0, "splits": "4", "epochs": 1}, "splits"),
        ("Split", {"worker": 0, "splits": 4, "epochs": 1.5}, "epochs"),
        ("Split", {"worker": 0, "splits": 4, "epochs": 1, "done": [0, 1]}, "done"),
        ("Split", {"worker": 0, "splits": 4, "epochs": 1, "done": [0, "1", 2]}, "done"),
        ("Split", {"worker": 0, "splits": 4, "epochs": 1, "wait": "0"}, "wait"),
        ("Heartbeat", {"worker": 0, "step": 1, "position": {"epoch": 0}}, "position"),
        ("Barrier", {"worker": 0, "name": "b", "wait": 0, "position": [0, 0]}, "position"),
        ("Leave", {"worker": 0, "position": [0, 0, 1, 2]}, "position"),
    ],
)
def test_a_malformed_split_or_position_is_refused_naming_the_field_and_changes_nothing(method, meta, field):
    coordinator, _ = make()
    service = CoordinatorService(coordinator)
    call(service, "Split", {"worker": 0, "splits": SPLITS, "epochs": EPOCHS})
    before, view = coordinator.data_state(), coordinator.view()
    with pytest.raises(MalformedFrameError, match=f"^coordinator {method} request[: ].*'{field}'"):
        service.call(method, codec.encode(meta))
    assert coordinator.data_state() == before and coordinator.view() == view


@pytest.mark.parametrize(
    "meta, error, fragment",
    [
        ({"splits": 0, "epochs": 1}, InvalidArgumentError, "num_splits"),
        ({"splits": 1 << 21, "epochs": 1}, InvalidArgumentError, "num_splits"),
        ({"splits": SPLITS, "epochs": EPOCHS, "done": [0, 3, 1]}, FailedPreconditionError, "does not hold split 3"),
        ({"splits": SPLITS, "epochs": EPOCHS, "done": [0, 0, -1]}, InvalidArgumentError, "position"),
        ({"splits": SPLITS, "epochs": EPOCHS, "wait": 61.0}, InvalidArgumentError, "split wait"),
    ],
    ids=["no-splits", "too-many-splits", "not-held", "negative-position", "long-wait"],
)
def test_a_well_formed_split_with_bad_values_is_refused_with_a_typed_error_and_changes_nothing(meta, error, fragment):
    coordinator, _ = make()
    service = CoordinatorService(coordinator)
    call(service, "Split", {"worker": 0, "splits": SPLITS, "epochs": EPOCHS})
    before = coordinator.data_state()
    with pytest.raises(error, match=fragment):
        service.call("Split", codec.encode({"worker": 0, **meta}))
    assert coordinator.data_state() == before
    assert given(coordinator, 0) == [0, 0, 0]
