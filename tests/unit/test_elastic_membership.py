"""Elastic runs' membership without processes (docs/elastic.md): the coordinator's elastic states and
barriers (a fake clock decides who is silent), a shard's quorum as workers register, leave and are
found gone, the launcher's choice of slots for a scale wish (fake children), and the wishes and
`paramserver scale` commands it refuses."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from tests.wait import finished, wait_until

from paramserver.base.consistency_spec import ConsistencySpec
from paramserver.base.errors import ConfigError, DeadlineExceededError, ParamServerError
from paramserver.coordinator.membership import Coordinator
from paramserver.launch.cli import commands
from paramserver.launch.local import elastic, run_files
from paramserver.launch.local.run_files import LauncherFiles
from paramserver.server.quorum import Quorum
from paramserver.server.shard import Push, Shard


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(slots: int = 4, timeout: float = 10.0) -> tuple[Coordinator, Clock]:
    clock = Clock()
    return Coordinator(slots, heartbeat_timeout_s=timeout, clock=clock, elastic=True), clock


def poll(coordinator: Coordinator, name: str, worker: int) -> dict:
    """Arrive at barrier `name` and look once (no wait: no verdict depends on this machine's speed)."""
    return coordinator.barrier(name, worker, wait_s=0)


# ---- the coordinator ---------------------------------------------------------------------------
def test_slots_no_worker_holds_are_absent_and_no_barrier_waits_for_them():
    coordinator, _ = make(4)
    assert [coordinator.state(w) for w in range(4)] == ["joining", "absent", "absent", "absent"]
    coordinator.join(0)
    coordinator.join(1)
    view = poll(coordinator, "b", 0)
    assert not view["open"] and view["waiting"] == [1]
    assert poll(coordinator, "b", 1)["open"]
    assert coordinator.view()["states"] == {"0": "training", "1": "training", "2": "absent", "3": "absent"}


def test_a_fixed_run_still_waits_for_a_worker_that_has_not_joined():
    clock = Clock()
    coordinator = Coordinator(2, heartbeat_timeout_s=10, clock=clock)
    coordinator.join(0)
    assert coordinator.state(1) == "joining"
    assert poll(coordinator, "b", 0)["waiting"] == [1]


def test_a_dead_worker_is_not_awaited_and_newly_gone_reports_it_once_with_a_died_event():
    coordinator, clock = make(3, timeout=10)
    for worker in range(3):
        coordinator.join(worker)
    clock.now = 5
    assert poll(coordinator, "b", 0)["waiting"] == [1, 2]
    coordinator.heartbeat(0, 3)
    coordinator.heartbeat(1, 7)
    clock.now = 11  # worker 2 silent for 11 s, workers 0 and 1 heard at 5
    assert coordinator.state(2) == "dead"
    assert poll(coordinator, "b", 1)["open"]  # opens without worker 2 (a fixed run would fail, naming it)
    assert coordinator.newly_gone() == [(2, "no heartbeat for 11s, and it has not joined again")]
    assert coordinator.newly_gone() == []
    assert [(e["worker"], e["event"]) for e in coordinator.events] == [
        (0, "joined"),
        (1, "joined"),
        (2, "joined"),
        (2, "died"),
    ]
    coordinator.join(2)  # a worker started in the slot again
    assert coordinator.events[-1]["event"] == "rejoined" and coordinator.state(2) == "training"


def test_a_worker_that_joins_after_a_barrier_began_meets_the_next_one():
    coordinator, clock = make(3)
    coordinator.join(0)
    coordinator.join(1)
    assert not poll(coordinator, "b", 0)["open"]
    clock.now = 1
    coordinator.join(2)  # after "b" began
    assert poll(coordinator, "b", 1)["open"]  # worker 2 is not awaited there
    clock.now = 2
    assert poll(coordinator, "next", 0)["waiting"] == [1, 2]  # but it is at the next one


def test_a_worker_that_left_is_awaited_nowhere_and_its_slot_may_join_again():
    coordinator, clock = make(3)
    for worker in range(3):
        coordinator.join(worker)
    assert poll(coordinator, "b", 0)["waiting"] == [1, 2]
    coordinator.leave(2)
    assert coordinator.state(2) == "exited"
    assert poll(coordinator, "b", 1)["open"]
    clock.now = 3
    coordinator.join(2)  # a scale-up started the slot again
    assert coordinator.state(2) == "training"
    assert poll(coordinator, "c", 0)["waiting"] == [1, 2]
    assert [(e["t"], e["worker"], e["event"]) for e in coordinator.events][-2:] == [
        (0.0, 2, "left"),
        (3.0, 2, "joined"),
    ]


def test_hello_has_the_events_in_an_elastic_run_only():
    coordinator, clock = make(3)
    coordinator.join(0)
    clock.now = 1.5
    coordinator.join(1)
    clock.now = 4.25
    coordinator.leave(1)
    hello = coordinator.hello()
    assert hello["elastic"] is True
    assert hello["events"] == [[0.0, 0, "joined"], [1.5, 1, "joined"], [4.25, 1, "left"]]
    assert hello["states"]["2"] == "absent"
    fixed = Coordinator(2, heartbeat_timeout_s=10, clock=Clock())
    fixed.join(0)
    assert "events" not in fixed.hello() and "elastic" not in fixed.hello()


def test_absent_slots_do_not_keep_the_coordinator_up():
    coordinator, clock = make(4)
    coordinator.join(0)
    coordinator.join(1)
    coordinator.leave(1)
    assert not coordinator.all_done(joining_grace_s=0)
    coordinator.leave(0)
    assert coordinator.all_done(joining_grace_s=30)  # slots 2 and 3 were never held: nothing to wait for


# ---- the shard's quorum ------------------------------------------------------------------------
def elastic_quorum() -> Quorum:
    quorum = Quorum()
    quorum.elastic = True
    return quorum


def test_an_elastic_quorum_counts_the_workers_registered_and_not_left_or_gone():
    quorum = elastic_quorum()
    assert quorum.size(4, 4) == 1 and quorum.awaited(4, set()) == []  # nobody yet: a step of one
    quorum.registered(0)
    quorum.registered(1)
    assert quorum.size(4, 4) == 2 and quorum.awaited(4, {0}) == [1] and quorum.active(4) == [0, 1]
    quorum.registered(3)
    assert quorum.size(4, 4) == 3 and quorum.is_returning(3)
    quorum.pushed(3, None)
    assert not quorum.is_returning(3)
    quorum.leave(3, None)  # its data is done (or it left the run)
    assert quorum.size(4, 4) == 2 and quorum.out(3)
    quorum.pushed(3, None)  # a push brings it back
    assert quorum.size(4, 4) == 3
    quorum.forget(1, "no heartbeat for 31s")  # found dead: out, not needed-but-gone
    assert quorum.size(4, 4) == 2 and quorum.awaited(4, set()) == [0, 3]
    assert quorum.needed_gone(4, set(), 3) == [] and quorum.gone == {}
    assert quorum.is_returning(1)  # a worker started in its slot again joins the step under way
    quorum.registered(1)
    assert quorum.size(4, 4) == 3


def test_a_fixed_quorum_still_needs_a_gone_worker():
    quorum = Quorum()
    quorum.forget(1, "no heartbeat for 31s")
    assert quorum.size(2, 2) == 2 and quorum.needed_gone(2, {0}, 2) == [1]


SGD1 = {"name": "sgd", "hyper": {"lr": 1.0}}


def elastic_shard(mode: str, slots: int, timeout: float = 10.0) -> Shard:
    shard = Shard(0, wait_timeout_s=timeout)
    spec = ConsistencySpec.parse(mode, slots, elastic=True)
    shard.register("g", SGD1, {"w": np.zeros(3, np.float32)}, spec, worker=0)
    return shard


def join(shard: Shard, worker: int, mode: str, slots: int) -> None:
    spec = ConsistencySpec.parse(mode, slots, elastic=True)
    shard.register("g", SGD1, {"w": np.zeros(3, np.float32)}, spec, worker=worker)


def push(shard: Shard, worker: int, grad: float, step: int | None = None):
    return shard.push(Push({"w": np.full(3, grad, np.float32)}, worker=worker, step=step))


def in_thread(fn, *args):
    import threading

    result: dict = {}

    def run():
        try:
            result["value"] = fn(*args)
        except ParamServerError as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def values(shard: Shard) -> list[float]:
    return shard.pull(["w"], lambda version, views: views[0][1].copy()).tolist()


def test_an_elastic_sync_step_takes_the_workers_present_and_applies_when_one_is_found_gone():
    shard = elastic_shard("sync", 4)
    push(shard, 0, 2.0, 0)  # alone in the run: the step applies at once
    join(shard, 1, "sync", 4)
    waiting, result = in_thread(push, shard, 0, 4.0, 1)
    wait_until(lambda: shard.describe()["waiting"] == 1, "worker 0's push waits for worker 1, registered")
    push(shard, 1, 2.0, 1)  # worker 1 joins the step under way
    finished(waiting, "the step with both workers")
    assert values(shard) == [-5.0] * 3 and shard.sync_step == 2  # -2, then -(4 + 2) / 2
    waiting, result = in_thread(push, shard, 0, 6.0, 2)
    wait_until(lambda: shard.describe()["waiting"] == 1, "worker 0's push waits for worker 1")
    shard.forget(1, "no heartbeat for 7s")  # the step under way applies without it
    finished(waiting, "the step without the dead worker")
    assert "error" not in result and values(shard) == [-11.0] * 3 and shard.sync_step == 3


def test_an_elastic_ssp_worker_that_joins_late_holds_no_one_back():
    """A newcomer's ssp clock starts where the workers present are, not at 0: else every worker
    waits at the bound until the newcomer has pushed as many steps as they did (a stall that grows
    with the run's length)."""
    shard = elastic_shard("ssp:2", 3, timeout=1.0)
    for _ in range(10):
        push(shard, 0, 1.0)
    join(shard, 1, "ssp:2", 3)
    try:
        push(shard, 0, 1.0)
    except DeadlineExceededError as exc:
        pytest.fail(f"worker 0 waited for the newcomer to catch up from clock 0: {exc}")
    push(shard, 1, 1.0)
    push(shard, 0, 1.0)
    assert shard.version == 13


def test_an_elastic_ssp_slot_started_again_after_its_worker_left_holds_no_one_back():
    shard = elastic_shard("ssp:2", 3, timeout=1.0)
    join(shard, 1, "ssp:2", 3)
    push(shard, 0, 1.0)
    push(shard, 1, 1.0)
    shard.leave(1)  # scaled down: worker 1 left the run
    for _ in range(10):
        push(shard, 0, 1.0)
    join(shard, 1, "ssp:2", 3)  # scaled up again: a new worker in slot 1
    try:
        push(shard, 0, 1.0)
    except DeadlineExceededError as exc:
        pytest.fail(f"worker 0 waited for slot 1 to catch up from its earlier worker's clock: {exc}")
    push(shard, 1, 1.0)  # its first push: counted from here on
    try:
        push(shard, 0, 1.0)
    except DeadlineExceededError as exc:
        pytest.fail(f"worker 0 waited for slot 1 to catch up from its earlier worker's clock: {exc}")
    assert shard.version == 15


# ---- the launcher's slots ----------------------------------------------------------------------
class FakeChild:
    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.code: int | None = None
        self.terminated = False

    def poll(self) -> int | None:
        return self.code

    def terminate(self) -> None:
        self.terminated = True


def follow(workers: list, wanted: int, leaving: set[int], max_workers: int = 4) -> elastic.Rescale:
    return elastic.follow(workers, wanted, leaving, FakeChild, max_workers)


def test_a_scale_up_fills_the_lowest_free_slots():
    workers = [FakeChild(0), FakeChild(1)]
    done = follow(workers, 4, set())
    assert [slot for slot, _ in done.started] == [2, 3] and done.stopping == []
    assert [child.slot for child in workers] == [0, 1, 2, 3]
    workers[1].code = 0  # slot 1's worker exited
    done = follow(workers, 4, set())
    assert [slot for slot, _ in done.started] == [1] and workers[1] is done.started[0][1]
    assert follow(workers, 4, set()).started == []  # nothing to do


def test_a_scale_down_stops_the_highest_slots_never_the_chief():
    workers = [FakeChild(slot) for slot in range(4)]
    leaving: set[int] = set()
    done = follow(workers, 2, leaving)
    assert done.stopping == [3, 2] and leaving == {2, 3} and done.started == []
    assert [child.terminated for child in workers] == [False, False, True, True]
    done = follow(workers, 1, leaving)  # those leaving already are not asked again
    assert done.stopping == [1] and leaving == {1, 2, 3} and not workers[0].terminated


def test_a_scale_up_while_workers_still_leave_waits_for_their_slots():
    """Slots 2 and 3 were asked to leave and have not exited yet: a wish for 4 again starts no slot
    beyond the run's 4 (a node would refuse the index, and its failure stop the run), nor one whose
    worker still leaves; it starts each once the launcher saw its worker go."""
    workers = [FakeChild(slot) for slot in range(4)]
    leaving: set[int] = set()
    follow(workers, 2, leaving)
    done = follow(workers, 4, leaving)
    assert [slot for slot, _ in done.started] == [] and done.short == 2 and len(workers) == 4
    workers[3].code = 0  # slot 3's worker left; the launcher saw it (supervisor._left)
    leaving.discard(3)
    done = follow(workers, 4, leaving)
    assert [slot for slot, _ in done.started] == [3] and done.short == 1 and leaving == {2}
    workers[2].code = 0
    leaving.discard(2)
    done = follow(workers, 4, leaving)
    assert [slot for slot, _ in done.started] == [2] and done.short == 0
    assert [child.poll() for child in workers] == [None] * 4


# ---- scale wishes ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, fragment",
    [
        ("not json", 'not {"workers": N}'),
        ('{"replicas": 2}', 'not {"workers": N}'),
        ("[2]", 'not {"workers": N}'),
        ('{"workers": 0}', "from 1 to 4, got 0"),
        ('{"workers": 5}', "from 1 to 4, got 5"),
        ('{"workers": true}', "from 1 to 4, got True"),
        ('{"workers": 2.0}', "from 1 to 4, got 2.0"),
        ('{"workers": "2"}', "from 1 to 4, got '2'"),
        ('{"workers": 2, "pad": "' + "x" * 5000 + '"}', "larger than 4096 bytes"),
    ],
)
def test_a_wish_that_is_not_a_worker_count_of_the_run_is_refused(tmp_path, text, fragment):
    path = tmp_path / "run-1-ab.scale"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        elastic.read_wish(path, 4)
    assert fragment in str(refused.value)


def test_a_refused_wish_changes_nothing_and_a_later_one_is_followed(tmp_path):
    run_path = tmp_path / "run-1-ab.json"
    workers = elastic.WorkerSet(max_workers=4, wanted=2, wish_path=elastic.scale_path(run_path))
    assert workers.new_wish() is None  # no wish yet
    elastic.scale_path(run_path).write_text('{"workers": 9}')
    with pytest.raises(ConfigError, match="got 9"):
        workers.new_wish()
    assert workers.wanted == 2 and workers.new_wish() is None  # read once, not again and again
    path = elastic.write_wish(run_path, 3)
    os.utime(path, ns=(1, 10**18))  # a new modification time, however coarse this file system's clock
    assert workers.new_wish() == 3 and workers.wanted == 3 and workers.new_wish() is None
    assert json.loads(path.read_text()) == {"workers": 3} and path.stat().st_mode & 0o777 == 0o600


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """Run files of this user's (launched by this process), in a runs directory of the test's own."""
    monkeypatch.setenv(run_files.RUN_DIR_ENV, str(tmp_path / "runs"))
    made: list[LauncherFiles] = []

    def write(max_workers: int) -> LauncherFiles:
        files = LauncherFiles.create()
        files.write({"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}, max_workers)
        made.append(files)
        return files

    yield write
    for files in made:
        files.remove()


def test_scale_asks_an_elastic_run_and_refuses_counts_it_cannot_take(runs, capsys):
    files = runs(4)
    assert commands.scale(["3"]) == 0
    assert json.loads(elastic.scale_path(files.run_path).read_text()) == {"workers": 3}
    assert "for 3 workers (of at most 4)" in capsys.readouterr().out
    for target, fragment in (
        (["0"], "from 1 to 4, got 0"),
        (["5"], "from 1 to 4, got 5"),
        (["-1"], "scale takes [RUN] N"),
        (["two"], "scale takes [RUN] N"),
        (["a", "b", "3"], "scale takes [RUN] N"),
    ):
        with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            commands.scale(target)
    assert json.loads(elastic.scale_path(files.run_path).read_text()) == {"workers": 3}  # unchanged


def test_scale_refuses_a_run_that_is_not_elastic_and_names_runs_to_choose_from(runs):
    fixed = runs(0)
    with pytest.raises(ConfigError, match="is not elastic: start it with --max-workers M"):
        commands.scale(["2"])
    assert not elastic.scale_path(fixed.run_path).exists()
    flexible = runs(4)
    with pytest.raises(ConfigError, match="name one"):
        commands.scale(["2"])
    assert commands.scale([flexible.run_path.stem, "2"]) == 0
    assert json.loads(elastic.scale_path(flexible.run_path).read_text()) == {"workers": 2}
