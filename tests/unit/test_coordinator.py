"""The coordinator's members, their states, global step and barriers (no transport).

A fake clock decides who is silent; barriers are polled with wait_s=0, so no verdict depends on
how fast this machine is."""

import logging
import threading

import pytest
from tests.wait import finished, wait_until

from paramserver.base.errors import FailedPreconditionError, InvalidArgumentError, UnavailableError
from paramserver.coordinator.membership import Coordinator


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(workers=2, timeout=10):
    clock = Clock()
    return Coordinator(workers, heartbeat_timeout_s=timeout, clock=clock), clock


def test_global_step_sums_the_workers_reported_steps():
    coordinator, _ = make()
    coordinator.join(0)
    coordinator.join(1)
    coordinator.heartbeat(0, 5)
    view = coordinator.heartbeat(1, 3)
    assert view["global_step"] == 8 and view["live"] == [0, 1]


def test_member_states_follow_joins_finishes_silences_and_exits():
    coordinator, clock = make(4)
    assert coordinator.state(0) == "joining"
    for worker in range(4):
        coordinator.join(worker)
    coordinator.finish(1)
    coordinator.leave(2)
    assert [coordinator.state(w) for w in range(4)] == ["training", "finished", "exited", "training"]
    clock.now = 11
    coordinator.heartbeat(0, 1)
    # silent past the timeout: a training member is dead, a finished one's work is done
    assert [coordinator.state(w) for w in range(4)] == ["training", "exited", "exited", "dead"]
    coordinator.join(3)  # restarted
    assert coordinator.state(3) == "training"


def test_a_barrier_opens_when_every_member_not_exited_arrived():
    coordinator, _ = make(3)
    for worker in range(3):
        coordinator.join(worker)
    coordinator.leave(2)
    first = coordinator.barrier("b", 0, wait_s=0)
    assert not first["open"] and first["waiting"] == [1]
    assert coordinator.barrier("b", 1, wait_s=0)["open"]
    assert coordinator.barrier("b", 0, wait_s=0)["open"]  # asked again: still open


def test_a_barrier_waits_for_a_worker_that_has_not_joined_and_for_a_finished_one():
    coordinator, clock = make(3)
    coordinator.join(0)
    coordinator.join(1)
    coordinator.finish(1)
    clock.now = 1000  # however long worker 2 takes to start, nothing fails
    coordinator.heartbeat(0, 1)
    coordinator.heartbeat(1, 1)
    assert coordinator.barrier("b", 0, wait_s=0)["waiting"] == [1, 2]
    coordinator.join(2)
    coordinator.barrier("b", 2, wait_s=0)
    assert coordinator.barrier("b", 1, wait_s=0)["open"]


def test_a_barrier_waits_on_a_slow_live_member_and_fails_at_once_naming_a_dead_one():
    coordinator, clock = make(2, timeout=10)
    coordinator.join(0)
    coordinator.join(1)
    for now in range(1, 100):  # worker 1 is slow but alive: heartbeats, no arrival
        clock.now = now
        coordinator.heartbeat(1, now)
        assert not coordinator.barrier("b", 0, wait_s=0)["open"]
    clock.now = 111  # worker 1 went silent
    with pytest.raises(UnavailableError, match=r"barrier 'b': worker 1 is gone \(no heartbeat for 12s"):
        coordinator.barrier("b", 0, wait_s=0)


def test_a_waiting_barrier_wakes_when_the_last_member_arrives():
    coordinator, _ = make()
    coordinator.join(0)
    coordinator.join(1)
    opened = threading.Event()
    started = threading.Event()

    def first():
        started.set()
        if coordinator.barrier("b", 0, wait_s=60)["open"]:
            opened.set()
    thread = threading.Thread(target=first, daemon=True)
    thread.start()
    started.wait(5)
    coordinator.barrier("b", 1, wait_s=0)
    assert opened.wait(30)


def test_newly_gone_reports_each_dead_member_once_until_it_joins_again():
    coordinator, clock = make(2)
    coordinator.join(0)
    coordinator.join(1)
    clock.now = 11
    coordinator.heartbeat(0, 1)
    gone = coordinator.newly_gone()
    assert [w for w, _ in gone] == [1] and "no heartbeat" in gone[0][1]
    assert coordinator.newly_gone() == []
    coordinator.join(1)
    clock.now = 30
    coordinator.heartbeat(0, 2)
    assert [w for w, _ in coordinator.newly_gone()] == [1]


def test_the_cluster_is_done_once_no_worker_may_need_the_coordinator():
    coordinator, clock = make(3)
    coordinator.join(0)
    coordinator.leave(0)
    assert not coordinator.all_done(joining_grace_s=60)  # workers 1 and 2 may still start
    coordinator.join(1)
    coordinator.join(2)
    coordinator.leave(1)
    assert not coordinator.all_done(joining_grace_s=60)  # worker 2 trains
    clock.now = 11  # worker 2 went silent: dead
    assert coordinator.all_done(joining_grace_s=60)


def test_workers_that_never_join_are_given_the_grace_only():
    coordinator, clock = make(2)
    coordinator.join(0)
    coordinator.leave(0)
    assert not coordinator.all_done(joining_grace_s=60)
    clock.now = 61
    assert coordinator.all_done(joining_grace_s=60)


@pytest.mark.parametrize("worker", [2, -1, True, "0"])
def test_workers_outside_the_cluster_are_refused(worker):
    with pytest.raises(InvalidArgumentError, match="outside"):
        Coordinator(2).join(worker)


@pytest.mark.parametrize("wait", [float("nan"), -1.0, 1e9])
def test_a_barrier_wait_out_of_range_is_refused_and_records_no_arrival(wait):
    coordinator, _ = make()
    coordinator.join(0)
    coordinator.join(1)
    with pytest.raises(InvalidArgumentError, match="barrier wait"):
        coordinator.barrier("b", 0, wait_s=wait)
    assert coordinator.barrier("b", 1, wait_s=0)["waiting"] == [0]


def test_a_stalled_member_heard_from_again_is_reported_again_if_it_dies_later():
    coordinator, clock = make(2)
    coordinator.join(0)
    coordinator.join(1)
    clock.now = 11
    coordinator.heartbeat(0, 1)
    assert [w for w, _ in coordinator.newly_gone()] == [1]
    coordinator.heartbeat(1, 1)  # only stalled
    assert coordinator.state(1) == "training"
    clock.now = 30
    coordinator.heartbeat(0, 2)
    assert [w for w, _ in coordinator.newly_gone()] == [1]


def test_what_the_host_publishes_reaches_every_worker_through_the_wire():
    from paramserver.coordinator.coordinator_service import CoordinatorClient, CoordinatorService
    from paramserver.transport.inprocess import InProcessChannel

    coordinator, _ = make()
    client = CoordinatorClient(InProcessChannel(CoordinatorService(coordinator), "inprocess:coordinator"), 1, 5.0)
    assert "published" not in coordinator.view()
    with pytest.raises(UnavailableError, match="no 'dense_sync'"):
        client.published("dense_sync", timeout=0.0)  # nothing published: one look, then the error
    reader = threading.Thread(target=lambda: found.append(client.published("dense_sync", timeout=60.0)))
    found: list[str] = []
    reader.start()
    coordinator.publish("dense_sync", "127.0.0.1:4242")
    finished(reader, "the client's read of the published address")
    assert found == ["127.0.0.1:4242"] and coordinator.view()["published"] == {"dense_sync": "127.0.0.1:4242"}


def test_barriers_that_wait_for_each_other_fail_within_the_heartbeat_timeout_naming_who_waits_where(caplog):
    coordinator, clock = make(3, timeout=10)
    for worker in range(3):
        coordinator.join(worker)
    coordinator.barrier("checkpoint#1", 0, wait_s=0, training_only=True)
    coordinator.barrier("mode@100", 1, wait_s=0, training_only=True)
    coordinator.barrier("mode@100", 2, wait_s=0, training_only=True)
    for now in range(1, 5):  # everyone alive and polling, nobody can arrive anywhere: not yet half the timeout
        clock.now = now
        for worker, barrier in ((0, "checkpoint#1"), (1, "mode@100"), (2, "mode@100")):
            coordinator.heartbeat(worker, 7)
            assert not coordinator.barrier(barrier, worker, wait_s=0, training_only=True)["open"]
    clock.now = 5
    with pytest.raises(FailedPreconditionError) as failed:
        coordinator.barrier("checkpoint#1", 0, wait_s=0, training_only=True)
    why = str(failed.value)
    assert "barrier 'checkpoint#1': arrived [0]; missing: worker 1 (waits at 'mode@100' for 5s), worker 2" in why
    assert "barrier 'mode@100': arrived [1, 2]; missing: worker 0 (waits at 'checkpoint#1' for 5s)" in why
    with pytest.raises(FailedPreconditionError, match="can never open"):  # the others hear it at their next poll
        coordinator.barrier("mode@100", 1, wait_s=0, training_only=True)


def test_a_barrier_waiting_for_a_training_worker_says_where_it_is_and_goes_on_waiting(caplog):
    coordinator, clock = make(2, timeout=10)
    coordinator.join(0)
    coordinator.join(1)
    with caplog.at_level(logging.INFO, logger="paramserver.coordinator.membership"):
        for now in range(0, 80):
            clock.now = now
            coordinator.heartbeat(1, 100 + now)
            assert not coordinator.barrier("b", 0, wait_s=0)["open"]
    said = [r.getMessage() for r in caplog.records if "barrier 'b'" in r.getMessage()]
    assert [s.rsplit(" ", 1)[-1] for s in said] == ["5s", "15s", "35s", "75s"]  # half the timeout, then doubling
    assert "barrier 'b': arrived [0]; missing: worker 1 (training at step 105, heard from 0s ago), after 5s" in said[0]


def test_a_checkpoint_announced_ends_the_poll_of_a_worker_waiting_elsewhere_and_requests_merge_until_written():
    coordinator, _ = make(2)
    coordinator.join(0)
    coordinator.join(1)
    polled = []
    thread = threading.Thread(target=lambda: polled.append(coordinator.barrier("mode@10", 1, wait_s=60)), daemon=True)
    thread.start()
    wait_until(lambda: 1 in coordinator._barriers.arrived.get("mode@10", ()), "worker 1 waiting at mode@10")
    view = coordinator.request_checkpoint(0)
    thread.join(30)
    assert not thread.is_alive() and polled[0]["open"] is False and polled[0]["checkpoints_requested"] == 1
    assert view["checkpoints_requested"] == coordinator.request_checkpoint(1)["checkpoints_requested"] == 1
    for barrier in ("checkpoint#1", "checkpoint#1:written"):
        coordinator.barrier(barrier, 0, wait_s=0, training_only=True)
        assert coordinator.barrier(barrier, 1, wait_s=0, training_only=True)["open"]
    assert coordinator.request_checkpoint(1)["checkpoints_requested"] == 2


def test_barriers_that_come_to_wait_for_each_other_late_fail_within_half_the_heartbeat_timeout():
    coordinator, clock = make(2, timeout=10)
    coordinator.join(0)
    coordinator.join(1)
    for now in range(0, 30):  # worker 1 trains for 30 s while worker 0 waits: nothing fails
        clock.now = now
        coordinator.heartbeat(0, 7)
        coordinator.heartbeat(1, now)
        assert not coordinator.barrier("eval", 0, wait_s=0)["open"]
    for now in range(30, 35):  # then it waits at another barrier, which waits for worker 0
        clock.now = now
        coordinator.heartbeat(0, 7)
        coordinator.heartbeat(1, 30)
        assert not coordinator.barrier("mode@100", 1, wait_s=0, training_only=True)["open"]
        assert not coordinator.barrier("eval", 0, wait_s=0)["open"]
    clock.now = 35
    with pytest.raises(FailedPreconditionError, match=r"worker 1 \(waits at 'mode@100' for 5s\)"):
        coordinator.barrier("eval", 0, wait_s=0)


def test_a_worker_stopping_to_be_restarted_stays_awaited_and_one_that_ends_leaves():
    """A worker exiting after a roll-back (its restart loop starts it again) does not leave: a chief
    done with its data keeps the coordinator up for it until it joins again or the heartbeat timeout
    finds it dead. One whose script ended leaves at once."""
    from paramserver.coordinator.coordinator_service import CoordinatorClient, CoordinatorService
    from paramserver.transport.inprocess import InProcessChannel

    coordinator, clock = make(3)
    clients = [
        CoordinatorClient(InProcessChannel(CoordinatorService(coordinator), "inprocess:coordinator"), w, 5.0, 60.0)
        for w in range(3)
    ]
    for client in clients:
        client.start()
        client.wait_ready(5.0)
    coordinator.finish(0)
    coordinator.leave(0)  # the chief's script ended
    clients[1].stop(1.0, leave=False)  # rolling back: restarted by its loop
    clients[2].stop(1.0)  # its script ended
    assert [coordinator.state(w) for w in range(3)] == ["exited", "training", "exited"]
    assert not coordinator.all_done()  # the chief keeps serving for the restart
    clock.now = 11  # past the heartbeat timeout, it never came back
    assert coordinator.state(1) == "dead" and coordinator.all_done()
    clients[0].stop(1.0)
