"""Partial recovery's decisions, without processes: when a lost PS is restored alone (and why not),
how a worker brings a shard back and counts the steps it lost, how the launcher sums them, and a
step's handle that keeps the other shards' replies when one shard is gone."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field

import pytest

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError, RollbackError, UnavailableError
from paramserver.base.lifecycle import RESTART_EXIT_CODE
from paramserver.client.ps_client import PushPullHandle
from paramserver.launch.local.shard_restart import why_not_alone
from paramserver.worker.progress import ProgressBoard
from paramserver.worker.recovery.partial import ShardRecovery, refusal, supported

PARTIAL = Options(recovery="partial", checkpoint_dir="/tmp/ckpt")


def test_partial_recovery_is_chosen_only_for_a_ps_in_async_mode_with_a_checkpoint():
    assert refusal(PARTIAL, True, ["ckpt-000000010"]) is None
    assert supported(PARTIAL) and not supported(Options())
    assert "rollback" in refusal(Options(checkpoint_dir="/tmp/ckpt"), True, ["ckpt-000000010"])
    assert "chief" in refusal(PARTIAL, False, ["ckpt-000000010"])
    assert "no complete checkpoint" in refusal(PARTIAL, True, [])
    assert "async" in refusal(Options(recovery="partial", checkpoint_dir="/c", mode="sync"), True, ["c"])
    assert "schedule" in refusal(Options(recovery="partial", checkpoint_dir="/c", mode_schedule="sync@5"), True, ["c"])
    with pytest.raises(ConfigError, match="needs a checkpoint_dir"):
        Options(recovery="partial")


def test_the_launcher_rolls_back_when_a_worker_asked_for_it_and_says_nothing_with_rollback(tmp_path):
    assert why_not_alone(Options(checkpoint_dir=str(tmp_path)), True, -9) == ""
    partial = Options(recovery="partial", checkpoint_dir=str(tmp_path))
    assert "asked for the roll-back" in why_not_alone(partial, False, RESTART_EXIT_CODE)
    assert "no complete checkpoint" in why_not_alone(partial, True, -9)  # the directory holds none
    (tmp_path / "ckpt-000000010").mkdir()
    (tmp_path / "ckpt-000000010" / "MANIFEST.json").write_text("{}")
    assert why_not_alone(partial, True, -9) is None


def test_recovery_is_an_option_checked_once():
    with pytest.raises(ConfigError, match="recovery"):
        Options(recovery="half")


def test_the_board_sums_each_recoverys_lost_steps_over_the_workers():
    board = ProgressBoard()
    for worker, steps in ((0, 7), (1, 5)):
        lost = {"shard": 1, "incarnation": "a1", "steps": steps, "checkpoint": "ckpt-000000050", "wait_s": 1.5 + worker}
        board.feed(json.dumps({"worker": worker, "lost": lost}))
    board.feed(json.dumps({"worker": 0, "lost": {"shard": 0, "incarnation": "b2", "steps": 0, "checkpoint": "c"}}))
    board.feed(json.dumps({"worker": 0, "lost": {"shard": "x"}}))  # malformed: ignored
    first, second = board.partial_recoveries()
    assert first == {"shard": 1, "checkpoint": "ckpt-000000050", "steps_lost": 12, "by_worker": {"0": 7, "1": 5},
                     "wait_s": 2.5}
    assert second["shard"] == 0 and second["steps_lost"] == 0
    board.freeze()
    board.feed(json.dumps({"worker": 1, "lost": {"shard": 1, "incarnation": "a1", "steps": 3, "checkpoint": "c"}}))
    assert board.partial_recoveries()[0]["steps_lost"] == 12  # a stopping worker's reports are not the run's


class _Call:
    def __init__(self, reply=None, error=None) -> None:
        self.reply, self.error = reply, error

    def wait(self, timeout):
        if self.error is not None:
            raise self.error
        return self.reply, {}


def test_a_step_handle_keeps_the_other_shards_replies_when_one_is_gone():
    calls = [(0, _Call("r0")), (1, _Call(error=UnavailableError("ps 1: connection refused"))), (2, _Call("r2"))]
    seen = {}
    handle = PushPullHandle(calls, {}, seen.update, tolerate_lost=True)
    replies, _ = handle.wait(1.0)
    assert replies == {0: "r0", 2: "r2"} == seen and list(handle.failed) == [1]
    with pytest.raises(UnavailableError):
        PushPullHandle(calls, {}).wait(1.0)  # the roll-back's way: the error ends the step
    rolled = [(0, _Call(error=RollbackError("worker 0 has not registered with this PS")))]
    assert list(PushPullHandle(rolled, {}, tolerate_lost=True).wait(1.0)[0]) == []


@dataclass
class _Channel:
    address: str
    hello: dict
    closed: bool = False

    def wait_ready(self, timeout):
        pass

    def close(self):
        self.closed = True


@dataclass
class _Client:
    channels: list
    position: int
    replaced: dict = field(default_factory=dict)

    @property
    def incarnations(self):
        return [channel.hello.get("incarnation") for channel in self.channels]

    def replace_channel(self, shard, channel):
        self.replaced[shard] = channel
        self.channels[shard] = channel

    def register_again(self, shard, timeout, write):
        write([("part", "values")])
        return self.position


@dataclass
class _Context:
    client: _Client
    worker_index: int = 1
    options: Options = PARTIAL
    optimizers: list = field(default_factory=list)
    rollback: object = None
    progress: object = None


class _Progress:
    def __init__(self) -> None:
        self.reports = []

    def lost(self, *report):
        self.reports.append(report)


class _Optimizer:
    steps = 40

    def __init__(self) -> None:
        self.loaded = []

    def load_parts(self, values):
        self.loaded.append(values)


@pytest.fixture
def listening():
    """An address whose port accepts TCP connections (a PS process that is up)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"127.0.0.1:{server.getsockname()[1]}"


def test_a_worker_brings_a_restored_shard_back_and_counts_the_steps_it_lost(listening):
    old = _Channel(listening, {"incarnation": "old"})
    new = _Channel(listening, {"incarnation": "new", "restored_from": "ckpt-000000030"})
    optimizer, progress = _Optimizer(), _Progress()
    ctx = _Context(_Client([_Channel(listening, {"incarnation": "zero"}), old], position=30),
                   optimizers=[optimizer], progress=progress)
    recovery = ShardRecovery(ctx, lambda shard: new, wait_s=5.0)
    assert recovery.recover(1, 41, UnavailableError("gone")) == 11  # steps 31-41: after its checkpoint
    assert ctx.client.replaced == {1: new} and optimizer.loaded == [[("part", "values")]]
    assert progress.reports[0][:4] == (1, "new", 11, "ckpt-000000030")


def test_a_shard_that_answers_as_the_same_process_is_not_recovered(listening):
    same = _Channel(listening, {"incarnation": "old"})
    ctx = _Context(_Client([_Channel(listening, {"incarnation": "old"})], position=0), progress=_Progress())
    cause = UnavailableError("deadline")
    with pytest.raises(UnavailableError, match="deadline"):
        ShardRecovery(ctx, lambda shard: same, wait_s=5.0).recover(0, 3, cause)
    assert same.closed


def test_a_shard_back_with_nothing_restored_or_not_back_in_time_rolls_the_cluster_back(listening):
    class Flag:
        reason = None

        def flag(self, reason):
            self.reason = reason

    empty = _Channel(listening, {"incarnation": "new"})
    ctx = _Context(_Client([_Channel(listening, {"incarnation": "old"})], 0), rollback=Flag(), progress=_Progress())
    with pytest.raises(RollbackError, match="no checkpoint"):
        ShardRecovery(ctx, lambda shard: empty, wait_s=5.0).recover(0, 3, UnavailableError("gone"))
    assert "partial recovery impossible" in ctx.rollback.reason
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{unused.getsockname()[1]}"  # bound, not listening: connections refused
        ctx = _Context(_Client([_Channel(closed, {"incarnation": "old"})], 0), progress=_Progress())
        with pytest.raises(RollbackError, match="did not come back within"):
            ShardRecovery(ctx, lambda shard: empty, wait_s=0.3).recover(0, 3, UnavailableError("gone"))


def test_a_lookup_that_finds_a_shard_gone_is_sent_again_once_it_is_back():
    from paramserver.client.table_client import TableClient

    tables = TableClient([], 1.0)
    answers = [UnavailableError("ps 1: connection reset"), "rows"]

    class Handle:
        def wait(self):
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

    tables.start_lookup = lambda table, ids: Handle()
    with pytest.raises(UnavailableError):
        tables.lookup("t", None)  # no partial recovery: the error is the caller's
    answers.insert(0, UnavailableError("ps 1: connection reset"))
    brought = []
    tables.on_lost = brought.append
    assert tables.lookup("t", None) == "rows" and len(brought) == 1
