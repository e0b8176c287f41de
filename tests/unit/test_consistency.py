"""Consistency modes at the shard: sync averaging, backup workers, ssp blocking, switching."""

import threading
import time

import numpy as np
import pytest

from paramserver.errors import (DeadlineExceededError, FailedPreconditionError, InvalidArgumentError,
                                ParamServerError)
from paramserver.server.consistency import ConsistencySpec
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
    time.sleep(0.2)
    assert first.is_alive() and shard.version == 0  # waits for worker 1
    push(shard, 1, [3, 2, 1], 0)
    first.join(5)
    assert result["value"].applied
    assert (shard.version, shard.sync_step) == (1, 1)
    np.testing.assert_allclose(value(shard), [-2, -2, -2])


def test_sync_refuses_a_second_push_for_the_same_step_and_keeps_the_average_clean():
    shard = make_shard("sync", 2)
    first, _ = in_thread(push, shard, 0, [1, 1, 1], 0)
    time.sleep(0.1)
    with pytest.raises(InvalidArgumentError, match="already pushed step 0"):
        push(shard, 0, [100, 100, 100], 0)
    push(shard, 1, [3, 3, 3], 0)
    first.join(5)
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
    time.sleep(0.1)
    push(shard, 1, [3, 3, 3], 0)
    first.join(5)
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
    time.sleep(0.3)
    assert third.is_alive()
    assert shard.version == 3  # its gradient is applied; only its worker waits
    push(shard, 1, [0, 0, 0])
    third.join(5)
    assert not third.is_alive() and "error" not in result


def test_ssp_0_is_sync():
    assert ConsistencySpec.parse("ssp:0", 2).mode == "sync"


def test_switching_from_sync_applies_the_partly_gathered_step():
    shard = make_shard("sync", 2)
    waiting, result = in_thread(push, shard, 0, [2, 2, 2], 0)
    time.sleep(0.1)
    shard.set_mode(ConsistencySpec.parse("async", 2))
    waiting.join(5)
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
    waiting.join(5)
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
