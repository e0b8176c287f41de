"""The chief's side of a checkpoint written in the background (client/checkpoint_write.py): every
shard's write ends before a failure is raised, a refusal is kept until the others are done, and a
file that stops growing fails the write."""

import pytest

from paramserver.base.errors import DeadlineExceededError, FailedPreconditionError
from paramserver.client import checkpoint_write
from paramserver.wire import messages as msg


class Call:
    def __init__(self, outcome):
        self.outcome = outcome

    def wait(self, timeout):
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome, {}


class Stub:
    """A shard that answers `begin` with `begun`, then each collect with the next of `polls`."""

    def __init__(self, index, polls, begun=None):
        self.index, self.polls, self.begun, self.collects = index, list(polls), begun, 0

    def checkpoint(self, request, timeout):
        if not request.collect:
            return Call(self.begun or msg.CheckpointReply(index=self.index, pending=True))
        self.collects += 1
        return Call(self.polls.pop(0))


class Ticking(Stub):
    """A shard whose every call takes a poll's time on `clock` (the time.monotonic the test set)."""

    def __init__(self, clock, polls):
        super().__init__(0, polls)
        self.clock = clock

    def checkpoint(self, request, timeout):
        self.clock[0] += checkpoint_write.POLL_S
        return super().checkpoint(request, timeout)


def ticking_clock(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(checkpoint_write.time, "monotonic", lambda: clock[0])
    return clock


def entry(index):
    return msg.CheckpointReply(index=index, file=f"shard-{index}.safetensors", bytes=10, sha256="ab")


def pending(index, written):
    return msg.CheckpointReply(index=index, pending=True, written=written)


def test_a_failed_shard_is_raised_only_once_every_other_shard_finished_its_file():
    gone = FailedPreconditionError("this PS has no write of it under way")
    stubs = [Stub(0, [gone]), Stub(1, [pending(1, 10), pending(1, 20), entry(1)])]
    write = checkpoint_write.begin(lambda: stubs, "ckpt-000000001", 1.0)
    with pytest.raises(FailedPreconditionError, match="no write of it"):
        write.collect()
    assert stubs[1].collects == 3 and 1 in write.done  # shard 1 was waited for to the end


def test_a_refused_begin_is_raised_after_the_shards_that_began_are_collected():
    refused = FailedPreconditionError("this PS still writes ckpt-000000001")
    stubs = [Stub(0, [entry(0)]), Stub(1, [], begun=refused)]
    write = checkpoint_write.begin(lambda: stubs, "ckpt-000000002", 1.0)
    assert write.begun and 1 in write.failed
    with pytest.raises(FailedPreconditionError, match="still writes"):
        write.collect()
    assert stubs[0].collects == 1 and stubs[1].collects == 0


def test_a_file_that_stops_growing_fails_the_write(monkeypatch):
    clock = ticking_clock(monkeypatch)
    polls = [pending(0, 5), pending(0, 9)] + [pending(0, 9)] * 100
    stubs = [Ticking(clock, polls)]
    write = checkpoint_write.begin(lambda: stubs, "ckpt-000000001", 1.0)
    with pytest.raises(DeadlineExceededError, match="has not grown"):
        write.collect()
    stalled_for = clock[0] - 2 * checkpoint_write.POLL_S  # since the file last grew
    assert checkpoint_write.STALL_S <= stalled_for <= checkpoint_write.STALL_S + checkpoint_write.POLL_S


def test_a_live_shard_that_writes_slowly_is_waited_for_however_long(monkeypatch):
    clock = ticking_clock(monkeypatch)
    polls = [pending(0, 100 * k) for k in range(1, 200)] + [entry(0)]
    stubs = [Ticking(clock, polls)]
    write = checkpoint_write.begin(lambda: stubs, "ckpt-000000001", 1.0)
    assert write.collect()[0]["file"] == "shard-0.safetensors" and clock[0] > 3 * checkpoint_write.STALL_S
