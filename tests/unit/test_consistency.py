"""Consistency modes at the shard: sync averaging, backup workers, ssp blocking, switching."""

import threading

import numpy as np
import pytest
from tests.wait import finished, wait_until

from paramserver.base.consistency_spec import ConsistencySpec
from paramserver.base.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    ParamServerError,
)
from paramserver.server.shard import Push, Shard

SGD1 = {"name": "sgd", "hyper": {"lr": 1.0}}


def make_shard(mode: str, workers: int, backups: int = 0, timeout: float = 10.0) -> Shard:
    shard = Shard(0, wait_timeout_s=timeout)
    shard.register("g", SGD1, {"w": np.zeros(3, np.float32)}, ConsistencySpec.parse(mode, workers, backups))
    return shard


def value(shard):
    return shard.pull(["w"], lambda version, views: views[0][1].copy())


def push(shard, worker, grad, step=None):
    return shard.push(Push({"w": np.asarray(grad, np.float32)}, worker=worker, step=step))


def in_thread(fn, *args):
    result = {}

    def run():
        try:
            result["value"] = fn(*args)
        except ParamServerError as exc:
            result["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_sync_averages_a_step_and_applies_it_once():
    shard = make_shard("sync", 2)
    first, result = in_thread(push, shard, 0, [1, 2, 3], 0)
    wait_until(lambda: shard.describe()["waiting"] == 1, "worker 0's push waits")
    assert shard.version == 0 and "value" not in result  # it waits for worker 1
    push(shard, 1, [3, 2, 1], 0)
    finished(first, "the first push to return")
    assert result["value"].applied
    assert (shard.version, shard.sync_step) == (1, 1)
    np.testing.assert_allclose(value(shard), [-2, -2, -2])


def test_sync_refuses_a_second_push_for_the_same_step_and_keeps_the_average_clean():
    shard = make_shard("sync", 2)
    first, _ = in_thread(push, shard, 0, [1, 1, 1], 0)
    wait_until(lambda: shard.describe()["waiting"] == 1, "worker 0's push waits")
    with pytest.raises(InvalidArgumentError, match="already pushed step 0"):
        push(shard, 0, [100, 100, 100], 0)
    push(shard, 1, [3, 3, 3], 0)
    finished(first, "the first push to return")
    np.testing.assert_allclose(value(shard), [-2, -2, -2])


def test_sync_refuses_a_worker_outside_the_cluster_and_a_step_from_the_future():
    shard = make_shard("sync", 2)
    with pytest.raises(InvalidArgumentError, match="worker 2 is outside"):
        push(shard, 2, [1, 1, 1], 0)
    with pytest.raises(FailedPreconditionError, match="pushed step 5"):
        push(shard, 0, [1, 1, 1], 5)
    assert shard.version == 0 and shard.describe()["pushes"] == 0


def test_backup_workers_apply_without_the_straggler_and_drop_its_late_gradient():
    shard = make_shard("sync", 3, backups=1)
    first, _ = in_thread(push, shard, 0, [1, 1, 1], 0)
    wait_until(lambda: shard.describe()["waiting"] == 1, "worker 0's push waits")
    push(shard, 1, [3, 3, 3], 0)
    finished(first, "the first push to return")
    np.testing.assert_allclose(value(shard), [-2, -2, -2])
    late = push(shard, 2, [1000, 1000, 1000], 0)  # the straggler's step 0 arrives after it was applied
    assert not late.applied and late.staleness == 1
    np.testing.assert_allclose(value(shard), [-2, -2, -2])
    assert shard.describe()["dropped_late"] == 1 and shard.version == 1


def test_ssp_blocks_a_worker_exactly_k_steps_ahead_of_the_slowest():
    shard = make_shard("ssp:2", 2)
    push(shard, 0, [1, 1, 1])  # ahead by 1
    push(shard, 0, [1, 1, 1])  # ahead by 2
    third, result = in_thread(push, shard, 0, [1, 1, 1])  # would be 3 ahead: waits
    wait_until(lambda: shard.describe()["waiting"] == 1, "the third push waits")
    assert "value" not in result
    assert shard.version == 3  # its gradient is applied; only its worker waits
    push(shard, 1, [0, 0, 0])
    finished(third, "the third push to return")
    assert not third.is_alive() and "error" not in result


def test_ssp_0_is_sync():
    assert ConsistencySpec.parse("ssp:0", 2).mode == "sync"


def test_switching_from_sync_applies_the_partly_gathered_step():
    shard = make_shard("sync", 2)
    waiting, result = in_thread(push, shard, 0, [2, 2, 2], 0)
    wait_until(lambda: shard.describe()["waiting"] == 1, "worker 0's push waits")
    shard.set_mode(ConsistencySpec.parse("async", 2))
    finished(waiting, "the waiting push to return")
    assert result["value"].applied
    np.testing.assert_allclose(value(shard), [-2, -2, -2])
    push(shard, 1, [1, 1, 1])  # async now: applied at once
    np.testing.assert_allclose(value(shard), [-3, -3, -3])
    assert shard.version == 2


def test_switching_to_sync_starts_at_the_current_step():
    shard = make_shard("async", 2)
    for _ in range(3):
        push(shard, 0, [1, 1, 1])
    shard.set_mode(ConsistencySpec.parse("sync", 2))
    waiting, _ = in_thread(push, shard, 0, [1, 1, 1], shard.sync_step)
    push(shard, 1, [1, 1, 1], shard.sync_step)
    finished(waiting, "the waiting push to return")
    assert shard.version == 4 and shard.sync_step == 1


def test_a_sync_step_that_never_completes_times_out():
    shard = make_shard("sync", 2, timeout=0.3)
    with pytest.raises(DeadlineExceededError, match=r"waiting for workers \[1\]"):
        push(shard, 0, [1, 1, 1], 0)


@pytest.mark.parametrize("text, workers, backups, fragment", [
    ("bulk", 2, 0, "unknown mode"),
    ("ssp", 2, 0, "needs a staleness bound"),
    ("sync:3", 2, 0, "only ssp takes"),
    ("sync", 2, 2, "fewer backups than workers"),
    ("async", 2, 1, "need sync mode"),
])
def test_bad_modes_are_clear_errors(text, workers, backups, fragment):
    with pytest.raises(InvalidArgumentError, match=fragment):
        ConsistencySpec.parse(text, workers, backups)


# ---- members joining late, finishing, coming back, gone for good ------------------------------


def test_a_worker_starting_late_joins_the_step_under_way_and_nothing_is_dropped():
    shard = make_shard("sync", 3, backups=1)
    first, _ = in_thread(push, shard, 0, [1, 1, 1], 0)
    push(shard, 1, [3, 3, 3], 0)  # step 0 applied with workers 0 and 1
    finished(first, "the first push to return")
    shard.register("g", SGD1, {"w": np.zeros(3, np.float32)}, ConsistencySpec.parse("sync", 3, 1), worker=2)
    assert shard.position(2) == 0  # a fresh worker starts its data at 0, whatever the cluster's step
    late, result = in_thread(push, shard, 2, [5, 5, 5], 0)  # it knows no step yet: claims 0
    push(shard, 0, [1, 1, 1], 1)
    finished(late, "the late worker's push to return")
    assert result["value"].applied and shard.describe()["dropped_late"] == 0
    np.testing.assert_allclose(value(shard), [-5, -5, -5])  # -(1+3)/2 - (5+1)/2
    assert (shard.position(0), shard.position(1), shard.position(2)) == (2, 1, 1)


def test_a_push_for_the_step_after_this_shards_joins_the_open_step_and_never_waits_for_itself():
    shard = make_shard("sync", 3, backups=1)
    first, _ = in_thread(push, shard, 0, [1, 1, 1], 0)
    wait_until(lambda: shard.describe()["pushes"] == 1, "worker 0's push of step 0 arrived")
    # worker 2 adopted step 1 from a shard that applied step 0 already; here step 0 is still open
    # and needs a second push: worker 2's is it (it never waits for its own push)
    ahead = push(shard, 2, [5, 5, 5], 1)
    finished(first, "the first push to return")
    assert ahead.applied and shard.sync_step == 1 and shard.describe()["dropped_late"] == 0
    np.testing.assert_allclose(value(shard), [-3, -3, -3])


def test_a_push_for_the_next_step_from_a_worker_that_pushed_the_open_one_waits_for_it():
    shard = make_shard("sync", 2)
    first, _ = in_thread(push, shard, 0, [1, 1, 1], 0)
    wait_until(lambda: shard.describe()["pushes"] == 1, "worker 0's push of step 0 arrived")
    early, result = in_thread(push, shard, 0, [3, 3, 3], 1)  # e.g. another shard let it go on already
    push(shard, 1, [1, 1, 1], 0)
    push(shard, 1, [1, 1, 1], 1)
    finished(first, "the first push to return")
    finished(early, "the early push for the next step to return")
    assert "error" not in result and shard.sync_step == 2
    np.testing.assert_allclose(value(shard), [-3, -3, -3])


def test_a_refused_push_changes_nothing():
    shard = make_shard("sync", 3)
    shard.leave(2, barrier="b")
    first, _ = in_thread(push, shard, 0, [1, 1, 1], 0)
    wait_until(lambda: shard.describe()["pushes"] == 1, "worker 0's push arrived")
    with pytest.raises(InvalidArgumentError, match="already pushed step 0"):
        shard.push(Push({"w": np.ones(3, np.float32)}, worker=0, step=0, resumed="b"))
    assert shard.position(0) == 1 and shard.describe()["pushes"] == 1
    push(shard, 1, [3, 3, 3], 0)  # worker 2 still waits at "b": the step needs workers 0 and 1 only
    finished(first, "the first push to return")
    assert shard.sync_step == 1


def test_a_finished_worker_leaves_the_quorum_and_its_next_push_joins_the_step_under_way():
    shard = make_shard("sync", 2)
    shard.leave(1)
    push(shard, 0, [2, 2, 2], 0)  # applied alone: no step waits for a finished worker
    push(shard, 0, [2, 2, 2], 1)
    assert shard.sync_step == 2
    back, result = in_thread(push, shard, 1, [4, 4, 4], 0)  # back from a barrier with an old step
    wait_until(lambda: shard.describe()["waiting"] == 1, "the returning worker's push waits in step 2")
    push(shard, 0, [2, 2, 2], 2)
    finished(back, "the returning worker's push to return")
    assert result["value"].applied and shard.sync_step == 3 and shard.describe()["dropped_late"] == 0
    np.testing.assert_allclose(value(shard), [-7, -7, -7])


def test_a_restarted_worker_that_pushed_the_open_step_before_dying_pushes_the_next_one():
    shard = make_shard("sync", 2)
    dying, _ = in_thread(push, shard, 1, [4, 4, 4], 0)  # its first life's push; then it is killed
    wait_until(lambda: shard.describe()["pushes"] == 1, "the first life's push arrived")
    shard.register("g", SGD1, {"w": np.zeros(3, np.float32)}, ConsistencySpec.parse("sync", 2), worker=1)
    assert shard.position(1) == 1  # it trained one batch: its second life goes on from there
    second, result = in_thread(push, shard, 1, [6, 6, 6], 0)
    push(shard, 0, [2, 2, 2], 0)  # completes step 0 with the first life's gradient
    finished(dying, "the first life's push to return")
    push(shard, 0, [2, 2, 2], 1)
    finished(second, "the second life's push to return")
    assert result["value"].applied and shard.sync_step == 2
    np.testing.assert_allclose(value(shard), [-7, -7, -7])  # -(4+2)/2 - (6+2)/2


def test_a_wait_that_needs_a_gone_worker_fails_at_once_naming_it():
    shard = make_shard("sync", 2, timeout=600)
    waiting, result = in_thread(push, shard, 0, [1, 1, 1], 0)
    shard.forget(1, "no heartbeat for 31s")
    finished(waiting, "the waiting push to return")
    assert not waiting.is_alive()
    assert "worker 1 is gone (no heartbeat for 31s)" in str(result["error"])


def test_with_a_backup_a_gone_worker_is_not_needed():
    shard = make_shard("sync", 3, backups=1, timeout=600)
    shard.forget(2, "no heartbeat for 31s")
    first, result = in_thread(push, shard, 0, [1, 1, 1], 0)
    push(shard, 1, [3, 3, 3], 0)
    finished(first, "the first push to return")
    assert result["value"].applied and shard.sync_step == 1


def test_a_worker_started_with_another_mode_is_refused_at_join_and_changes_nothing():
    shard = make_shard("sync", 2)
    for other in (ConsistencySpec.parse("async", 2), ConsistencySpec.parse("sync", 3)):
        with pytest.raises(FailedPreconditionError, match="joined with mode .* start every node with the same"):
            shard.register("g", SGD1, {"w": np.ones(3, np.float32)}, other, worker=1)
    with pytest.raises(FailedPreconditionError, match="joined with mode"):
        shard.adopt_mode(ConsistencySpec.parse("async", 2))
    assert str(shard.spec) == "sync" and shard.version == 0
    np.testing.assert_allclose(value(shard), [0, 0, 0])
    shard.set_mode(ConsistencySpec.parse("async", 2))  # a switch while training: a restarted worker
    shard.register("g", SGD1, {"w": np.ones(3, np.float32)}, ConsistencySpec.parse("sync", 2), worker=1)


def test_workers_back_from_a_barrier_are_back_at_once_and_no_one_takes_a_step_alone():
    shard = make_shard("sync", 2)
    shard.leave(0, barrier="checkpoint@10")
    shard.leave(1, barrier="checkpoint@10")
    first, result = in_thread(lambda: shard.push(Push({"w": np.full(3, 2, np.float32)}, worker=0, step=0,
                                                      resumed="checkpoint@10")))
    wait_until(lambda: shard.describe()["pushes"] == 1, "worker 0's push arrived")
    assert shard.sync_step == 0  # it waits for worker 1, which the barrier's opening brought back
    shard.push(Push({"w": np.full(3, 4, np.float32)}, worker=1, step=0, resumed="checkpoint@10"))
    finished(first, "the first push to return")
    assert result["value"].applied and shard.sync_step == 1
    np.testing.assert_allclose(value(shard), [-3, -3, -3])


def test_a_worker_behind_a_barrier_steps_alone_until_it_gets_there():
    shard = make_shard("sync", 2)
    shard.leave(0, barrier="checkpoint@10")  # worker 0 is at the barrier; worker 1 is behind it
    push(shard, 1, [2, 2, 2], 0)
    push(shard, 1, [2, 2, 2], 1)
    assert shard.sync_step == 2


def test_a_worker_found_dead_at_a_barrier_is_still_known_gone_when_the_barrier_opens():
    shard = make_shard("sync", 2, timeout=600)
    shard.leave(1, barrier="b")
    shard.forget(1, "no heartbeat for 31s")
    waiting, result = in_thread(lambda: shard.push(Push({"w": np.ones(3, np.float32)}, worker=0, step=0,
                                                        resumed="b")))
    finished(waiting, "the waiting push to return")
    assert not waiting.is_alive() and "worker 1 is gone" in str(result["error"])
