"""`Trainer.evaluate`'s metrics (AUC and log loss checked against exact references), `fit`'s
validation and TensorBoard scalars, and its callbacks (EarlyStopping, BestCheckpoint), on in-process shards."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import paramserver as ps
from paramserver.evaluation.metrics import log_loss, roc_auc
from paramserver.trainer_callbacks import BestCheckpoint, Callback, EarlyStopping
from paramserver.worker.summaries import open_summaries

SEED = 7
DIM = 4


def pairwise_auc(labels, scores):
    """The exact reference: the share of (positive, negative) pairs ranked right, ties counting half."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def plain_log_loss(labels, probabilities):
    return -sum(y * math.log(p) + (1 - y) * math.log(1 - p) for y, p in zip(labels, probabilities)) / len(labels)


class CTR(torch.nn.Module):
    """A dense input and a table's ids, one logit per example."""

    def __init__(self, sigmoid=False):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3 + DIM, 1)
        self.emb = ps.nn.HashEmbedding(DIM, std=0.1)
        self.sigmoid = sigmoid

    def forward(self, dense, ids):
        logit = self.fc(torch.cat([dense, self.emb(ids)], dim=1)).squeeze(1)
        return torch.sigmoid(logit) if self.sigmoid else logit


def ctr_batches(steps, seed=SEED):
    """Clicks that follow the first dense feature, with noise (both classes in every set)."""
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        dense, ids = torch.randn(16, 3, generator=g), torch.randint(0, 50, (16,), generator=g)
        y = ((dense[:, 0] + 0.7 * torch.randn(16, generator=g)) > 0).float()
        out.append((dense, ids, y))
    return out


def test_the_numpy_metrics_equal_exact_references_with_ties():
    print(f"seed {SEED}")
    rng = np.random.default_rng(SEED)
    labels = rng.integers(0, 2, 60)
    scores = np.round(rng.random(60), 1)  # ties on purpose
    assert roc_auc(labels, scores) == pytest.approx(pairwise_auc(labels, scores), abs=1e-12)
    p = rng.uniform(0.01, 0.99, 60)
    assert log_loss(labels, p) == pytest.approx(plain_log_loss(labels, p), rel=1e-12)
    assert log_loss([1, 0], [0.0, 1.0]) == pytest.approx(-math.log(1e-7), rel=1e-6)  # clipped, not infinite


@pytest.mark.parametrize("sigmoid", [False, True])
def test_evaluate_gives_a_binary_model_auc_and_log_loss_of_its_outputs(sigmoid, fresh_context):
    ps.init(num_ps=2)
    model = CTR(sigmoid)
    loss_fn = torch.nn.BCELoss() if sigmoid else torch.nn.BCEWithLogitsLoss()
    trainer = ps.Trainer(model, ps.optim.Adam(model.named_parameters(), lr=0.05), loss_fn, verbose=False)
    trainer.fit(ctr_batches(20), epochs=2)
    held_out = ctr_batches(8, seed=SEED + 1)
    metrics = trainer.evaluate(held_out)
    with torch.no_grad():  # the reference: the pulled model's own outputs, by hand
        out = torch.cat([model(dense, ids) for dense, ids, _ in held_out])
    p = (out if sigmoid else torch.sigmoid(out)).tolist()
    labels = torch.cat([y for *_, y in held_out]).tolist()
    assert set(metrics) == {"loss", "auc", "log_loss", "accuracy", "examples"}
    assert metrics["examples"] == 128
    assert metrics["auc"] == pytest.approx(pairwise_auc(labels, p), abs=1e-9)
    assert metrics["log_loss"] == pytest.approx(plain_log_loss(labels, p), rel=1e-5)
    assert metrics["loss"] == pytest.approx(metrics["log_loss"], rel=1e-4)  # the same quantity, both ways
    assert metrics["accuracy"] == pytest.approx(np.mean([(q >= 0.5) == (t == 1) for q, t in zip(p, labels)]))
    assert metrics["auc"] > 0.75  # it learned the rule


def test_metrics_take_names_and_callables_and_refuse_an_unknown_name(fresh_context):
    ps.init()
    model = CTR()
    trainer = ps.Trainer(model, ps.optim.SGD(model.named_parameters(), lr=0.1), F.binary_cross_entropy_with_logits)
    data = ctr_batches(3)

    def positives(out, y):
        return y.sum()

    got = trainer.evaluate(data, metrics=["auc", positives])
    assert set(got) == {"loss", "auc", "positives", "examples"}
    assert got["positives"] == sum(y.sum().item() for *_, y in data)
    assert set(trainer.evaluate(data, metrics={"mean_logit": lambda out, y: out.mean()})) == {
        "loss",
        "mean_logit",
        "examples",
    }
    with pytest.raises(ps.InvalidArgumentError, match="unknown metric 'aucc'"):
        trainer.evaluate(data, metrics=["aucc"])
    regression = ps.Trainer(model, trainer.optimizer, F.mse_loss, verbose=False)
    data = [(dense, ids, y * 3.5) for dense, ids, y in data]
    assert set(regression.evaluate(data)) == {"loss", "examples"}
    with pytest.raises(ps.InvalidArgumentError, match="needs a binary model"):
        regression.evaluate(data, metrics=["auc"])


def test_auc_of_one_class_is_nan(fresh_context):
    ps.init()
    model = CTR()
    trainer = ps.Trainer(model, ps.optim.SGD(model.named_parameters(), lr=0.1), torch.nn.BCEWithLogitsLoss())
    data = [(dense, ids, torch.ones_like(y)) for dense, ids, y in ctr_batches(2)]
    assert math.isnan(trainer.evaluate(data)["auc"])


def train(validation=None, every=None, callbacks=(), steps=12, epochs=2):
    """Fit a fresh CTR model on in-process shards; its trained weights, history and trainer."""
    ctx = ps.init(num_ps=2)
    model = CTR()
    opt = ps.optim.SGD(model.named_parameters(), lr=0.1)
    trainer = ps.Trainer(model, opt, torch.nn.BCEWithLogitsLoss(), verbose=False)
    history = trainer.fit(
        ctr_batches(steps), epochs=epochs, validation_data=validation, validation_every=every, callbacks=callbacks
    )
    opt.pull()
    weights = model.emb(torch.arange(50)).detach().clone(), model.fc.weight.detach().clone()
    return weights, history, trainer, ctx


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def on_train_begin(self, trainer):
        self.calls.append(("begin",))

    def on_validation_end(self, trainer, step, logs):
        self.calls.append(("validation", step, sorted(logs)))

    def on_epoch_end(self, trainer, epoch, logs):
        self.calls.append(("epoch", epoch, sorted(logs)))

    def on_train_end(self, trainer):
        self.calls.append(("end",))


def test_validation_during_fit_changes_no_training_and_calls_back_in_order(fresh_context):
    (rows, weight), _, _, ctx = train()
    ctx.shutdown()
    recorder = Recorder()
    held_out = ctr_batches(4, seed=SEED + 1)
    (rows_v, weight_v), history, trainer, ctx = train(held_out, every=6, callbacks=[recorder])
    assert torch.equal(rows, rows_v) and torch.equal(weight, weight_v)  # the pipeline's rows were not disturbed
    val = ["val_accuracy", "val_auc", "val_log_loss", "val_loss"]
    assert recorder.calls == [
        ("begin",),
        ("validation", 6, val),
        ("validation", 12, val),
        ("epoch", 1, ["loss", *val]),
        ("validation", 18, val),
        ("validation", 24, val),
        ("epoch", 2, ["loss", *val]),
        ("end",),
    ]
    final = trainer.evaluate(held_out)  # the last validation ran after the last step: the same state
    assert history[1].validation == {key: value for key, value in final.items() if key != "examples"}


def test_validation_at_each_epoch_end_goes_to_tensorboard(tmp_path, fresh_context):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ctx = ps.init(num_ps=1)
    model = CTR()
    opt = ps.optim.SGD(model.named_parameters(), lr=0.1)
    ctx.summaries = open_summaries(str(tmp_path), 1000, 0, ctx.client.record)
    trainer = ps.Trainer(model, opt, torch.nn.BCEWithLogitsLoss(), verbose=False)
    history = trainer.fit(ctr_batches(6), epochs=3, validation_data=ctr_batches(2, seed=SEED + 1))
    ctx.summaries.stop()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    auc = events.Scalars("validation/auc")
    assert [e.step for e in auc] == [6, 12, 18]
    assert [e.value for e in auc] == pytest.approx([h.validation["auc"] for h in history], abs=1e-6)
    assert "validation/log_loss" in events.Tags()["scalars"]


def test_early_stopping_stops_after_patience_and_finishes_this_workers_data(fresh_context):
    scripted = iter([0.5, 0.4, 0.41, 0.395, 0.45, 0.30])  # val_loss at each validation

    def scripted_loss(out, y):
        return next(scripted)

    ctx = ps.init()
    model = CTR()
    trainer = ps.Trainer(model, ps.optim.SGD(model.named_parameters(), lr=0.1), torch.nn.BCEWithLogitsLoss())
    stop = EarlyStopping("val_score", patience=1, min_delta=0.01)
    history = trainer.fit(
        ctr_batches(10),
        epochs=3,
        validation_data=ctr_batches(1),
        validation_every=2,
        metrics={"score": scripted_loss},
        callbacks=[stop],
    )
    # 0.5 best, 0.4 best, 0.41 waits, 0.395 waits (not 0.01 better): stopped at the 4th validation, step 8
    assert (stop.stopped_step, stop.best, stop.best_step, stop.mode) == (8, 0.4, 4, "min")
    assert trainer.steps == 8 and len(history) == 1 and history[0].steps == 8
    assert ctx.finished  # no step of another worker waits for this one


def test_early_stopping_refuses_a_metric_the_logs_lack(fresh_context):
    ps.init()
    model = CTR()
    trainer = ps.Trainer(model, ps.optim.SGD(model.named_parameters(), lr=0.1), torch.nn.BCEWithLogitsLoss())
    with pytest.raises(ps.InvalidArgumentError, match="'val_auc', a validation metric: it needs"):
        trainer.fit(ctr_batches(2), callbacks=[EarlyStopping("val_auc")])
    with pytest.raises(ps.InvalidArgumentError, match="validation_every needs validation_data"):
        trainer.fit(ctr_batches(2), validation_every=1)
    with pytest.raises(ps.InvalidArgumentError, match="validation_every must be"):
        trainer.fit(ctr_batches(2), validation_data=ctr_batches(1), validation_every=0)
    assert trainer.steps == 0  # refused before any step
    with pytest.raises(ps.InvalidArgumentError, match="'val_aucc', which the logs do not have"):
        trainer.fit(ctr_batches(2), validation_data=ctr_batches(1), callbacks=[EarlyStopping("val_aucc")])
    with pytest.raises(ps.InvalidArgumentError, match="mode"):
        EarlyStopping(mode="up")


def test_best_checkpoint_asks_the_coordinator_on_each_new_best_only(fresh_context):
    scripted = iter([0.6, 0.7, 0.65, 0.71, 0.71])

    def score(out, y):
        return next(scripted)

    ctx = ps.init()
    model = CTR()
    trainer = ps.Trainer(model, ps.optim.SGD(model.named_parameters(), lr=0.1), torch.nn.BCEWithLogitsLoss())
    best = BestCheckpoint("val_score_auc", min_delta=0.005)  # "auc" in the name: higher is better
    asked_at = []
    request = ctx.coordinator.request_checkpoint

    def spy():
        asked_at.append(trainer.steps)
        return request()  # the real coordinator's

    ctx.coordinator.request_checkpoint = spy
    ctx.checkpointer = _NoCheckpoints()  # stands for a checkpoint_dir: only its presence is read
    try:
        trainer.fit(
            ctr_batches(5),
            validation_data=ctr_batches(1),
            validation_every=1,
            metrics={"score_auc": score},
            callbacks=[best],
        )
    finally:
        ctx.checkpointer = None
    assert best.requested == 3 and (best.best, best.best_step) == (0.71, 4)
    assert asked_at == [1, 2, 4]  # at each new best: 0.6, 0.7, 0.71 (0.71 again is no better)
    assert ctx.cluster_view()["checkpoints_requested"] == 1  # announced (requests merge until it is written)


class _NoCheckpoints:
    pass
