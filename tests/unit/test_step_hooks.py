"""A worker's step does only what the features that are on need: Context.on_step's hooks, and a
dense push that calls no compressor for a variable without a codec."""

import signal
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from paramserver.base.compression_spec import parse as parse_codec
from paramserver.base.config import Options
from paramserver.base.consistency_spec import ModeChange
from paramserver.base.errors import RollbackError
from paramserver.client.compression import GradientCompressor
from paramserver.client.ps_client import PSClient
from paramserver.client.table_client import TableClient
from paramserver.nn.wire_dtype import wire_array, write_wire
from paramserver.node.in_process import in_process_shards
from paramserver.worker.context import Context
from paramserver.worker.modes import ModeSwitcher
from paramserver.worker.progress import ProgressWriter
from paramserver.worker.recovery import preemption
from paramserver.worker.recovery.rollback import RollbackFlag

SGD = {"name": "sgd", "hyper": {"lr": 1.0}}


class Coordinator:
    """The coordinator client's part a step touches: the heartbeat's step, resume after finishing."""

    def __init__(self):
        self.step, self.resumed = 0, 0

    def resume(self):
        self.resumed += 1


class Modes(ModeSwitcher):
    """The real mode schedule, counting how often a step consults it."""

    def __init__(self, schedule=(), barrier=None):
        super().__init__(SimpleNamespace(set_mode=lambda spec: None), 0, 1, schedule, barrier=barrier)
        self.consulted = 0

    def due(self, step):
        self.consulted += 1
        return super().due(step)

    def on_step(self, step, timeout=300.0):
        self.consulted += 1
        super().on_step(step, timeout)


class Checkpointer:
    """A checkpointer due every `every` steps, recording the steps it met the others at."""

    def __init__(self, every):
        self.every, self.met = every, []

    def due(self, step):
        return step % self.every == 0

    def on_step(self, step, timeout):
        if self.due(step):
            self.met.append(step)


def context(modes=None, **features) -> Context:
    client = PSClient(in_process_shards(1), 1.0)
    return Context(0, 1, 0, client, Options(), True, ProgressWriter(-1, 0), modes or Modes(), Coordinator(), **features)


def test_a_step_with_every_feature_off_counts_itself_and_consults_nothing_else():
    ctx = context()
    for step in range(1, 6):
        assert not ctx.pauses_at(step)
        ctx.on_step(step)
    assert ctx.progress.steps == 5 and ctx.coordinator.step == 5
    assert ctx.modes.consulted == 0  # no schedule: neither due() nor on_step() ran


def test_a_mode_schedule_is_consulted_until_its_last_switch_then_no_more():
    met = []
    ctx = context(Modes([ModeChange(2, "sync"), ModeChange(3, "async")], barrier=lambda name, t: met.append(name)))
    for step in range(1, 4):
        ctx.pauses_at(step)
        ctx.on_step(step)
    assert met == ["mode@2", "mode@2:switched", "mode@3", "mode@3:switched"]
    consulted = ctx.modes.consulted
    for step in range(4, 10):
        assert not ctx.pauses_at(step)
        ctx.on_step(step)
    assert ctx.modes.consulted == consulted and ctx.progress.steps == 9


def test_a_checkpointer_meets_the_others_at_its_steps():
    ctx = context(checkpointer=Checkpointer(every=3))
    due = [step for step in range(1, 8) if ctx.pauses_at(step)]
    for step in range(1, 8):
        ctx.on_step(step)
    assert due == [3, 6] and ctx.checkpointer.met == [3, 6]


def test_a_flagged_roll_back_stops_the_next_step_before_it_counts():
    exits = []
    rollback = RollbackFlag(grace_s=0.0, exit_process=exits.append)
    ctx = context(rollback=rollback)
    ctx.on_step(1)
    rollback.flag("ps 0 restarted")
    with pytest.raises(RollbackError, match="ps 0 restarted"):
        ctx.on_step(2)
    assert ctx.progress.steps == 1


def test_a_push_after_finishing_brings_the_worker_back():
    ctx = context()
    ctx.finished = True
    ctx.on_step(1)
    assert not ctx.finished and ctx.coordinator.resumed == 1


def test_preemption_is_looked_for_only_once_installed(monkeypatch):
    monkeypatch.setattr(preemption, "requested", lambda: signal.SIGTERM)
    context().on_step(1)  # not installed: a request is not looked for
    monkeypatch.setattr(preemption, "installed", lambda: True)
    with pytest.raises(preemption.Preempted, match="SIGTERM after step 4"):
        context().on_step(4)


# ---- the push: no compressor call for a variable without a codec -------------------------------
class Spy(GradientCompressor):
    def __init__(self):
        super().__init__()
        self.encoded = []

    def encode(self, var, name, grad, rows=None):
        self.encoded.append(var)
        return super().encode(var, name, grad, rows)

    def encode_rows(self, codec, name, grads):
        self.encoded.append(name)
        return super().encode_rows(codec, name, grads)


def test_only_variables_with_a_codec_go_through_the_compressor_and_every_byte_is_counted():
    client = PSClient(in_process_shards(2), 10.0, split_bytes=256)  # "big" is split over both shards
    client.compressor = spy = Spy()
    values = {"big": np.zeros((40, 4), np.float32), "small": np.zeros(3, np.float32)}
    client.register("g", SGD, values, codecs={"small": parse_codec("fp16")}).wait(10.0)
    grads = {"big": np.ones((40, 4), np.float32), "small": np.ones(3, np.float32)}
    _, pulled = client.push_pull(grads, ["big", "small"]).wait(10.0)
    assert len(client.parts_of["big"]) > 1 and spy.encoded == ["small"]
    assert spy.gradient_bytes == 40 * 4 * 4 + 3 * 2
    got = {part.name: array for part, array in pulled}
    np.testing.assert_array_equal(np.concatenate([got[p.name] for p in client.parts_of["big"]]), -grads["big"])
    np.testing.assert_array_equal(got[client.parts_of["small"][0].name], -grads["small"])


def test_row_gradients_of_a_table_without_a_codec_go_as_they_are():
    spy = Spy()
    tables = TableClient(in_process_shards(2), 10.0, compressor=spy)
    tables.register("plain", 4, SGD, {"kind": "zeros"})
    tables.register("small", 4, SGD, {"kind": "zeros"}, compression=parse_codec("fp16"))
    riders = tables.riders()
    ids = np.arange(10, dtype=np.int64)
    riders.push("plain", ids, np.ones((10, 4), np.float32))
    riders.push("small", ids, np.ones((10, 4), np.float32))
    pushed = [dict(riders.on(shard).tensors) for shard in range(2)]
    assert spy.encoded == ["r1.grads", "r1.grads"]  # the fp16 table's, on each shard
    assert sum(p["r0.grads"].nbytes for p in pushed) == 10 * 4 * 4 and spy.gradient_bytes == 10 * 4 * (4 + 2)
    assert all(p["r0.grads"].dtype == np.float32 for p in pushed)


# ---- wire dtypes: the float32 fast paths give what the general ones give -------------------------
def test_a_float32_gradient_travels_as_a_view_and_values_land_in_place():
    param = torch.nn.Parameter(torch.zeros(5, 3))
    param.grad = torch.arange(15.0).reshape(5, 3)
    array = wire_array(param.grad)
    assert array.dtype == np.float32 and np.shares_memory(array, param.grad.numpy())
    write_wire("p", param.data[1:3], np.full((2, 3), 7.0, np.float32))
    assert param.data[1:3].eq(7.0).all() and param.data[0].eq(0.0).all() and param.data[3:].eq(0.0).all()
    assert wire_array(param).dtype == np.float32  # a tensor that requires grad is detached first
    half = torch.ones(4, dtype=torch.bfloat16)
    assert wire_array(half).dtype == np.uint16
