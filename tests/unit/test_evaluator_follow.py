"""The evaluator's follow loop on a real checkpoint store (no cluster): each new complete checkpoint
is loaded into a torch model, dense values and embedding rows as a PS reading it would answer, and
evaluated; partial checkpoints are never read; damaged ones and a failing function are logged and
skipped; it ends at the checkpoint marked final, or after its timeout. And the evaluator's Context."""

import json
import logging

import numpy as np
import pytest
import torch
import torch.nn as nn
from tests.unit.test_checkpointer import Coordinator, checkpointer

import paramserver as ps
from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task
from paramserver.base.errors import FailedPreconditionError
from paramserver.checkpoint.files import shard_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointError, CheckpointStore, checkpoint_name
from paramserver.evaluation.evaluator import Evaluator
from paramserver.server.shard import Shard
from paramserver.serving.checkpoint_model import load_into
from paramserver.tables.embedding_table import initial_rows
from paramserver.tables.table_store import TableStore

SGD = {"name": "sgd", "hyper": {"lr": 0.1}}
ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
INIT = {"kind": "normal", "std": 0.5}
SAVED_IDS = np.array([3, 10, 77], np.int64)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = ps.nn.HashEmbedding(2, init="normal", std=0.5)
        self.fc = nn.Linear(2, 1)

    def forward(self, ids):
        return self.fc(self.emb(ids)).squeeze(-1)


def write(directory, step, scale, final=False, names=("opt0.fc.weight", "opt0.fc.bias"), table="opt0.emb"):
    """A one-shard checkpoint of Model, as a PS writes it: weight = scale, bias = 1, rows of
    SAVED_IDS = scale * (1 + their index)."""
    shard, tables = Shard(0), TableStore(0)
    shard.register("opt0.group0", SGD, {names[0]: np.full((1, 2), scale, np.float32),
                                        names[1]: np.ones(1, np.float32)})
    tables.register(table, 2, ADAGRAD, INIT, num_shards=1)
    saved = tables.table(table)  # rows as a restore would put them
    saved.load_rows(SAVED_IDS, {"values": scale * np.array([[1, 1], [2, 2], [3, 3]], np.float32)})
    store, name = CheckpointStore(str(directory)), checkpoint_name(step)
    entries = [shard_file.write(store, name, shard, tables).__dict__]
    store.commit(name, {"step": step, "num_shards": 1, "shards": entries, **({"final": True} if final else {})})
    return name


def expected(scale, ids):
    """What Model gives for `ids` at a checkpoint written with `scale`."""
    rows = initial_rows(np.asarray(ids, np.int64), 2, INIT)
    for i, saved in enumerate(SAVED_IDS):
        rows[np.asarray(ids) == saved] = scale * (i + 1)
    return rows.sum(axis=1) * scale + 1


def follow(directory, fn, timeout_s=0.0, clock=None):
    store = CheckpointStore(str(directory))
    kwargs = {"clock": clock} if clock is not None else {}
    return Evaluator(Model(), fn, store, timeout_s=timeout_s, poll_s=0.01, **kwargs).run()


IDS = torch.tensor([3, 10, 77, 5, 123456789])  # two ids no checkpoint holds: their initial rows


def test_loading_gives_the_dense_values_and_the_rows_a_ps_would_answer(tmp_path):
    name = write(tmp_path, 10, 0.5)
    model = Model()
    load_into(model, RestoreSource(CheckpointStore(str(tmp_path)), name))
    with torch.no_grad():
        assert model(IDS).numpy() == pytest.approx(expected(0.5, IDS.numpy()), abs=1e-6)
    assert model.fc.weight.tolist() == [[0.5, 0.5]]


def test_positional_names_are_the_models_parameters_in_order(tmp_path):
    # an optimizer given model.parameters(): emb.placeholder is param0, fc.weight param1, fc.bias param2
    name = write(tmp_path, 10, 2.0, names=("opt0.param1", "opt0.param2"), table="opt0.param0")
    model = Model()
    load_into(model, RestoreSource(CheckpointStore(str(tmp_path)), name))
    with torch.no_grad():
        assert model(IDS).numpy() == pytest.approx(expected(2.0, IDS.numpy()), abs=1e-5)


def test_a_checkpoint_of_another_model_is_an_error_naming_what_differs(tmp_path):
    name = write(tmp_path, 10, 1.0, names=("opt0.head.weight", "opt0.head.bias"))
    with pytest.raises(CheckpointError, match="the model has no parameter head.bias, head.weight"):
        load_into(Model(), RestoreSource(CheckpointStore(str(tmp_path)), name))
    name = write(tmp_path, 20, 1.0, table="opt0.other")
    with pytest.raises(CheckpointError, match="no table for the model's HashEmbedding 'emb'"):
        load_into(Model(), RestoreSource(CheckpointStore(str(tmp_path)), name))


def test_each_new_checkpoint_is_evaluated_partial_ones_never_read_and_it_ends_at_the_final_one(tmp_path,
                                                                                                monkeypatch):
    write(tmp_path, 10, 1.0)
    read = []
    real_open = CheckpointStore.open_shard
    monkeypatch.setattr(CheckpointStore, "open_shard", lambda self, name, entry: read.append(name) or
                        real_open(self, name, entry))

    def fn(model, step):  # training goes on meanwhile: each evaluation sees the next checkpoint appear
        if step == 10:
            write(tmp_path, 20, 2.0)
        elif step == 20:
            (tmp_path / checkpoint_name(25)).mkdir()  # being written: a shard file, no manifest yet
            (tmp_path / checkpoint_name(25) / "shard-0.safetensors").write_bytes(b"half")
            write(tmp_path, 30, 3.0, final=True)
        return {"out": model(IDS).sum(), "step": step}

    done = follow(tmp_path, fn)
    assert [(e.checkpoint, e.step, e.final) for e in done] == [
        ("ckpt-000000010", 10, False), ("ckpt-000000020", 20, False), ("ckpt-000000030", 30, True)]
    for evaluation, scale in zip(done, (1.0, 2.0, 3.0)):
        assert evaluation.metrics["out"] == pytest.approx(expected(scale, IDS.numpy()).sum(), rel=1e-6)
        assert evaluation.metrics["step"] == evaluation.step
    assert checkpoint_name(25) not in read


class Training(CheckpointStore):
    """A store whose run takes its next action each time the evaluator lists it: no thread, no sleep."""

    def __init__(self, directory, *actions):
        super().__init__(str(directory))
        self.actions = list(actions)

    def complete(self):
        if self.actions:
            self.actions.pop(0)()
        return super().complete()


def damage(directory, name):
    shard = directory / name / "shard-0.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"!")  # its SHA-256 no longer matches the manifest


def test_a_damaged_checkpoint_and_a_failing_function_are_logged_and_the_next_one_is_evaluated(tmp_path, caplog):
    store = Training(tmp_path, lambda: write(tmp_path, 10, 1.0),
                     lambda: damage(tmp_path, write(tmp_path, 20, 2.0)),
                     lambda: write(tmp_path, 30, 3.0), lambda: write(tmp_path, 40, 4.0, final=True))

    def fn(model, step):
        if step == 30:
            raise ValueError("the user's bug")
        return {"w": model.fc.weight[0, 0]}
    with caplog.at_level(logging.INFO, "paramserver.evaluation.evaluator"):
        done = Evaluator(Model(), fn, store, poll_s=0.01).run()
    assert [(e.step, e.metrics) for e in done] == [(10, {"w": 1.0}), (20, None), (30, None), (40, {"w": 4.0})]
    assert "SHA-256" in done[1].error and done[2].error == "ValueError: the user's bug" and done[3].final
    assert "cannot load ckpt-000000020" in caplog.text and "function failed on ckpt-000000030" in caplog.text
    assert "the user's bug" in caplog.text  # with its traceback
    events = [(r.event, r.step) for r in caplog.records if getattr(r, "event", "").startswith("evaluation")]
    assert events == [("evaluation", 10), ("evaluation_failed", 20), ("evaluation_failed", 30), ("evaluation", 40)]
    assert [r.metrics for r in caplog.records if getattr(r, "event", "") == "evaluation"] == [{"w": 1.0}, {"w": 4.0}]


def test_it_waits_for_a_first_checkpoint_and_ends_after_its_timeout_without_one(tmp_path):
    now = [0.0]

    def clock():
        now[0] += 1.0  # every look at the clock: a second later
        return now[0]
    assert follow(tmp_path / "not-yet", lambda model: {}, timeout_s=30, clock=clock) == []
    assert now[0] >= 30


def test_a_periodic_checkpoint_marked_final_afterwards_ends_it_without_a_second_evaluation(tmp_path):
    name = write(tmp_path, 10, 1.0)
    calls = []

    def fn(model):
        calls.append(1)
        CheckpointStore(str(tmp_path)).mark_final(name)  # the chief: the final checkpoint is this one
        return {}
    done = follow(tmp_path, fn)
    assert len(done) == 1 and len(calls) == 1
    manifest = json.loads((tmp_path / name / "MANIFEST.json").read_text())
    assert manifest["final"] is True and manifest["step"] == 10


def test_a_final_checkpoint_rewriting_the_one_of_its_step_is_evaluated_again(tmp_path):
    write(tmp_path, 10, 1.0)
    seen = []

    def fn(model):
        seen.append(model.fc.weight[0, 0].item())
        if len(seen) == 1:  # async workers trained on past the chief's step: the final one replaces it
            store = CheckpointStore(str(tmp_path))
            store.uncommit(checkpoint_name(10))
            write(tmp_path, 10, 5.0, final=True)
        return {}
    assert [e.final for e in follow(tmp_path, fn)] == [False, True]
    assert seen == [1.0, 5.0]


def test_the_chief_marks_its_final_checkpoint_in_the_manifest(tmp_path):
    chief, _, client = checkpointer(tmp_path, 0, Coordinator(), every=10)
    client.pushes = 20
    chief.on_step(20, 1.0)
    chief.settle()  # its commit, written in the background
    store = CheckpointStore(str(tmp_path))
    assert "final" not in store.manifest("ckpt-000000020")  # a periodic one
    assert chief.save_final(20, 1.0) == "ckpt-000000020" and client.saved == ["ckpt-000000020"]
    assert store.manifest("ckpt-000000020")["final"] is True  # not written again: marked
    client.pushes = 30
    assert chief.save_final(23, 1.0) == "ckpt-000000023"
    assert store.manifest("ckpt-000000023")["final"] is True  # written as the final one


def evaluator_config(directory=""):
    cluster = ClusterSpec.from_dict({"ps": ["localhost:1"], "worker": ["localhost:2"], "evaluator": ["localhost:3"]})
    return NodeConfig(cluster, Task("evaluator", 0), Options(checkpoint_dir=str(directory)))


def test_init_on_an_evaluator_task_joins_nothing_and_refuses_an_optimizer(tmp_path, fresh_context):
    ctx = ps.init(evaluator_config(tmp_path))  # no PS listens at localhost:1: nothing is reached
    assert ctx.is_evaluator and ctx.role == "evaluator" and not ctx.is_chief and ps.init() is ctx
    with pytest.raises(FailedPreconditionError, match="evaluator task"):
        ps.optim.SGD(Model().parameters(), lr=0.1)
    write(tmp_path, 10, 1.0, final=True)
    done = ps.evaluate(Model(), lambda model: {"w": model.fc.weight.sum()})
    assert [(e.checkpoint, e.metrics) for e in done] == [("ckpt-000000010", {"w": 2.0})]


def test_evaluate_is_refused_on_a_training_task(fresh_context):
    ctx = ps.init()  # an in-process cluster: a training task
    assert not ctx.is_evaluator
    with pytest.raises(FailedPreconditionError, match="evaluator task"):
        ps.evaluate(Model(), lambda model: {})
