"""The pieces of recovery inside the cluster, one by one (the whole is tests/fault/test_in_cluster_recovery.py)."""

import threading
from concurrent.futures import Future

import numpy as np
import pytest
from tests.unit.test_bad_input import SGD, state

from paramserver.base.errors import RollbackError, UnavailableError
from paramserver.base.lifecycle import RESTART_EXIT_CODE
from paramserver.coordinator.coordinator_service import CoordinatorClient, CoordinatorService
from paramserver.coordinator.membership import Coordinator
from paramserver.server.shard import Shard
from paramserver.server.shard_service import ShardService
from paramserver.transport.channel import FutureCall
from paramserver.transport.inprocess import InProcessChannel
from paramserver.wire import codec
from paramserver.wire import messages as msg
from paramserver.worker.recovery.rollback import RollbackFlag, restarted_shard, roll_back_shards

ROWS = {"name": "adagrad", "hyper": {"lr": 0.1}}


def fenced_service() -> ShardService:
    """A shard as a PS node serves it: pushes only from workers that registered with this process."""
    service = ShardService(Shard(0))
    service.shard.sessions = set()
    service.call("Register", codec.encode({"group": "g", "optimizer": SGD, "worker": 0},
                                          [("w", np.arange(4, dtype=np.float32))]))
    return service


def push(service, worker):
    return service.call("PushPull", codec.encode({"worker": worker, "pull": ["w"]},
                                                 [("w", np.ones(4, dtype=np.float32))]))


def test_a_push_from_a_worker_that_did_not_register_with_this_process_is_refused_and_changes_nothing():
    service = fenced_service()
    before = state(service)
    with pytest.raises(RollbackError, match="worker 1 has not registered with this PS"):
        push(service, 1)
    assert state(service) == before
    push(service, 0)  # the worker that registered pushes
    assert state(service) != before


def test_a_worker_that_registered_a_table_may_push_rows():
    service = fenced_service()
    service.call("RegisterTable", codec.encode({"table": "t", "dim": 4, "optimizer": ROWS, "init": {"kind": "zeros"},
                                                "worker": 2}))
    push(service, 2)
    assert codec.decode(service.call("Hello", codec.encode({}))).meta["version"] == 1


def test_hello_names_the_groups_a_shard_holds():
    service = ShardService(Shard(0))
    assert codec.decode(service.call("Hello", codec.encode({}))).meta.get("groups", 0) == 0
    service.call("Register", codec.encode({"group": "g", "optimizer": SGD, "worker": 0},
                                          [("w", np.zeros(2, dtype=np.float32))]))
    assert codec.decode(service.call("Hello", codec.encode({}))).meta["groups"] == 1


def test_a_shutdown_asking_a_restart_is_claimed_as_the_chiefs_restart():
    service = ShardService(Shard(0))  # who may: tests/unit/test_roles.py
    request = codec.encode(msg.ShutdownRequest(reason="roll-back", restart=True).to_meta())
    assert service.claim(service.decode("Shutdown", request)).action == "Restart"
    assert service.claim(service.decode("Shutdown", codec.encode(msg.ShutdownRequest().to_meta()))).action == "Shutdown"


def test_a_restart_request_tells_the_node_to_restart():
    service = ShardService(Shard(0))
    asked = []
    service.on_shutdown = asked.append
    service.call("Shutdown", codec.encode(msg.ShutdownRequest(restart=True).to_meta()))
    service.call("Shutdown", codec.encode(msg.ShutdownRequest().to_meta()))
    assert asked == [True, False]


class FakePS:
    """A PS process behind one address: `restart()` makes it another process (a new incarnation)."""

    def __init__(self, holds_state: bool) -> None:
        self.incarnation, self.restarts = "a", 0
        self.hello = {"incarnation": "a", "groups": int(holds_state)}
        self.down = False

    def call(self, method, payload, timeout, owned=False):
        result = Future()
        if self.down:
            result.set_exception(UnavailableError("restarting"))
        elif method == "Hello":
            reply = msg.HelloReply(shard=0, protocol=[codec.PROTOCOL_MAJOR, codec.PROTOCOL_MINOR], version=0,
                                   sync_step=0, mode="async", pushes=0, dropped_late=0, waiting=0, staleness_max=0,
                                   staleness_mean=0.0, tables={}, incarnation=self.incarnation)
            result.set_result(codec.encode(reply.to_meta()))
        elif method == "Shutdown":
            payload = b"".join(payload) if isinstance(payload, list) else payload  # a frame in parts, as stubs send
            assert msg.ShutdownRequest.from_meta(codec.decode(payload).meta).restart
            self.restarts += 1
            self.down = True
            threading.Timer(0.3, self._back).start()  # its restart loop starts it again
            result.set_result(codec.encode({"version": 0}))
        return FutureCall(result, method)

    def _back(self):
        self.incarnation, self.down = f"b{self.restarts}", False


def test_a_chief_restarts_every_shard_when_one_holds_state_and_waits_until_they_are_back():
    # a shard that looked fresh may still take pushes from a worker of before the roll-back, and
    # count batches the restarted shards never saw: it restarts too
    holding, fresh = FakePS(True), FakePS(False)
    assert roll_back_shards([holding, fresh], timeout=30) == [0, 1]
    assert (holding.restarts, fresh.restarts) == (1, 1)
    assert (holding.incarnation, fresh.incarnation) == ("b1", "b1")


def test_a_chief_at_a_fresh_start_restarts_nothing():
    shards = [FakePS(False), FakePS(False)]
    assert roll_back_shards(shards, timeout=30) == []
    assert [s.restarts for s in shards] == [0, 0]


def test_a_shard_that_restarted_or_does_not_answer_is_named():
    ps = FakePS(True)
    assert restarted_shard([ps], ["a"]) is None
    ps.incarnation = "z"
    assert "ps 0 restarted" in restarted_shard([ps], ["a"])
    ps.down = True
    assert "ps 0 does not answer" in restarted_shard([ps], ["a"])
    assert restarted_shard([ps], [None]) is None  # in-process: never restarts


def test_the_flag_is_set_once_raises_between_steps_and_exits_for_the_restart_loop():
    exited = threading.Event()
    codes = []
    flag = RollbackFlag(0.05, lambda code: (codes.append(code), exited.set()))
    flag.check()
    flag.flag("ps 1 restarted")
    flag.flag("the coordinator restarted")  # the first reason stays
    with pytest.raises(RollbackError, match="ps 1 restarted"):
        flag.check()
    assert exited.wait(30) and codes == [RESTART_EXIT_CODE]


def test_a_worker_learns_from_any_reply_that_the_coordinator_restarted():
    service = CoordinatorService(Coordinator(2))
    flagged = []
    client = CoordinatorClient(InProcessChannel(service, "inprocess:coordinator"), 1, 5.0, on_restart=flagged.append)
    client._call("Join")
    client._call("Heartbeat", step=1)
    assert flagged == [] and client.restarted() is None
    service.coordinator = restarted = Coordinator(2)  # the chief restarted: another coordinator answers
    service.methods = CoordinatorService(restarted).methods
    client._call("Heartbeat", step=2)
    assert "the coordinator restarted" in flagged[0]
    assert "restarted" in client.restarted()


def test_workers_resumed_at_different_steps_meet_at_the_one_checkpoint_the_coordinator_announced():
    coordinator = Coordinator(3)  # the chief restarted: a new coordinator, workers resumed at steps 45, 40, 45
    for worker in range(3):
        coordinator.join(worker)
    number = coordinator.request_checkpoint(0)["checkpoints_requested"]
    for worker in (0, 2):
        assert not coordinator.barrier(f"checkpoint#{number}", worker, 0.0, training_only=True)["open"]
    assert coordinator.barrier(f"checkpoint#{number}", 1, 0.0, training_only=True)["open"]
