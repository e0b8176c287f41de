"""When workers meet for a checkpoint: every N steps, or when the chief's clock says so."""

from paramserver.checkpoint.store import CheckpointStore
from paramserver.worker.checkpoints import Checkpointer


class Coordinator:
    def __init__(self):
        self.view = {"checkpoints_requested": 0}

    def request_checkpoint(self):
        self.view["checkpoints_requested"] += 1
        return self.view


class Client:
    channels = [object()]
    consistency = type("Spec", (), {"to_dict": lambda self: {"mode": "async"}})()

    def __init__(self):
        self.saved = []

    def checkpoint(self, directory, name, timeout):
        self.saved.append(name)
        return [{"index": 0, "file": "shard-0.safetensors", "bytes": 1, "sha256": "x"}]


def checkpointer(tmp_path, worker, coordinator, clock, every=0, every_seconds=0.0):
    barriers, client = [], Client()
    return Checkpointer(client, CheckpointStore(str(tmp_path)), every, 3, worker,
                        lambda name, timeout: barriers.append(name), every_seconds, coordinator,
                        clock=lambda: clock[0]), barriers, client


def test_the_chiefs_clock_asks_and_every_worker_meets_after_its_next_step(tmp_path):
    coordinator, clock = Coordinator(), [0.0]
    chief, chief_barriers, client = checkpointer(tmp_path, 0, coordinator, clock, every_seconds=10)
    other, other_barriers, _ = checkpointer(tmp_path, 1, coordinator, clock, every_seconds=10)
    clock[0] = 5
    assert not chief.due(1) and not other.due(7)
    clock[0] = 11
    assert chief.due(2)  # the chief asks now...
    assert coordinator.view["checkpoints_requested"] == 1
    chief.on_step(2, 1.0)
    assert chief_barriers == ["checkpoint#1", "checkpoint#1:written"] and client.saved == ["ckpt-000000002"]
    assert other.due(9)  # ...and the other worker, whatever its step, meets after its next one
    other.on_step(9, 1.0)
    assert other_barriers == ["checkpoint#1", "checkpoint#1:written"]
    clock[0] = 15
    assert not chief.due(3) and not other.due(10)  # 10 s from the last checkpoint, not from the start


def test_step_checkpoints_meet_at_every_nth_step_only(tmp_path):
    coordinator, clock = Coordinator(), [0.0]
    chief, barriers, client = checkpointer(tmp_path, 0, coordinator, clock, every=5)
    assert [step for step in range(1, 16) if chief.due(step)] == [5, 10, 15]
    chief.on_step(5, 1.0)
    assert barriers == ["checkpoint@5", "checkpoint@5:written"] and client.saved == ["ckpt-000000005"]
