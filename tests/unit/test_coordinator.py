"""The coordinator's membership, global step and barriers (no transport)."""

import threading

import pytest

from paramserver.coordinator.membership import Coordinator
from paramserver.errors import DeadlineExceededError, InvalidArgumentError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_global_step_sums_the_workers_reported_steps():
    coordinator = Coordinator(2)
    coordinator.join(0)
    coordinator.join(1)
    coordinator.heartbeat(0, 5)
    view = coordinator.heartbeat(1, 3)
    assert view["global_step"] == 8 and view["live"] == [0, 1]


def test_a_silent_member_drops_out_of_the_live_set():
    clock = Clock()
    coordinator = Coordinator(2, heartbeat_timeout_s=10, clock=clock)
    coordinator.join(0)
    coordinator.join(1)
    clock.now = 8
    coordinator.heartbeat(0, 1)
    clock.now = 15
    assert coordinator.view()["live"] == [0]


def test_a_barrier_opens_when_every_live_member_arrived():
    coordinator = Coordinator(2)
    coordinator.join(0)
    coordinator.join(1)
    arrived = threading.Event()

    def first():
        coordinator.barrier("b", 0, timeout=10)
        arrived.set()
    thread = threading.Thread(target=first, daemon=True)
    thread.start()
    assert not arrived.wait(0.3)
    coordinator.barrier("b", 1, timeout=10)
    assert arrived.wait(5)


def test_a_barrier_does_not_wait_for_members_that_left():
    coordinator = Coordinator(3)
    for worker in range(3):
        coordinator.join(worker)
    coordinator.leave(2)
    threading.Thread(target=coordinator.barrier, args=("b", 1, 10), daemon=True).start()
    coordinator.barrier("b", 0, timeout=5)


def test_a_barrier_names_who_is_missing_when_it_times_out():
    coordinator = Coordinator(2)
    coordinator.join(0)
    coordinator.join(1)
    with pytest.raises(DeadlineExceededError, match=r"workers \[1\] did not arrive"):
        coordinator.barrier("b", 0, timeout=0.2)


def test_workers_outside_the_cluster_are_refused():
    with pytest.raises(InvalidArgumentError, match="outside"):
        Coordinator(2).join(2)


def test_the_cluster_is_done_only_once_every_worker_joined_and_left():
    clock = Clock()
    coordinator = Coordinator(3, heartbeat_timeout_s=10, clock=clock)
    coordinator.join(0)
    coordinator.leave(0)
    assert not coordinator.all_done()  # workers 1 and 2 have not even joined: the host must stay up
    coordinator.join(1)
    coordinator.join(2)
    coordinator.leave(1)
    assert not coordinator.all_done()
    clock.now = 11  # worker 2 went silent
    assert coordinator.all_done()


def test_a_barrier_waits_for_a_worker_that_has_not_joined_yet():
    coordinator = Coordinator(2)
    coordinator.join(0)
    with pytest.raises(DeadlineExceededError, match=r"workers \[1\] did not arrive"):
        coordinator.barrier("start", 0, timeout=0.2)  # worker 1 is slow to start: still expected
    arrived = threading.Thread(target=lambda: (coordinator.join(1), coordinator.barrier("go", 1, 5)))
    arrived.start()
    coordinator.barrier("go", 0, 5)
    arrived.join(5)
