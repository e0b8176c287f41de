"""ctx.resumable(): a worker's data from its own position on, then it finishes its data."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import paramserver as ps
from paramserver.worker.resumable import ResumableBatches


def fake_context(resume_step=0, optimizers=(SimpleNamespace(overlap=True, _embeddings=()),)):
    ctx = SimpleNamespace(resume_step=resume_step, optimizers=list(optimizers), worker_index=1, finished=0,
                          data_position=0)
    ctx.finish_training = lambda: setattr(ctx, "finished", ctx.finished + 1)
    return ctx


def shuffled_loader(seed=3):
    data = TensorDataset(torch.arange(20).float().unsqueeze(1), torch.arange(20))
    return DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed))


def labels(batches):
    return [batch[1].tolist() for batch in batches]


def test_a_fresh_worker_gets_every_batch_of_every_epoch_then_finishes_its_data():
    ctx = fake_context()
    data = ResumableBatches([1, 2, 3], epochs=2, context=ctx)
    seen = []
    for batch in data:
        assert ctx.finished == 0  # not before the last batch was consumed
        seen.append(batch)
    assert seen == [1, 2, 3, 1, 2, 3] and ctx.finished == 1 and data.position == 6


def test_a_restarted_worker_goes_on_where_it_was_in_a_shuffled_loader():
    undisturbed = labels(ResumableBatches(shuffled_loader(), epochs=3, context=fake_context()))
    resumed = labels(ResumableBatches(shuffled_loader(), epochs=3, context=fake_context(resume_step=7)))
    assert len(undisturbed) == 15 and resumed == undisturbed[7:]  # same order, none skipped, none twice


def test_epochs_of_a_generator_come_from_a_callable_given_the_epoch():
    epochs_asked = []

    def batches(epoch):
        epochs_asked.append(epoch)
        return (f"e{epoch}b{i}" for i in range(2))
    out = list(ResumableBatches(batches, epochs=3, context=fake_context(resume_step=3)))
    assert out == ["e1b1", "e2b0", "e2b1"] and epochs_asked == [0, 1, 2]


def test_by_epoch_gives_fully_skipped_epochs_too():
    data = ResumableBatches([1, 2], epochs=3, context=fake_context(resume_step=3))
    assert [(epoch, list(batches)) for epoch, batches in data.by_epoch()] == [(0, []), (1, [2]), (2, [1, 2])]


def test_steps_per_epoch_cycles_the_loader():
    data = ResumableBatches([1, 2, 3], epochs=2, steps_per_epoch=2, context=fake_context(resume_step=1))
    assert list(data) == [2, 3, 1]


@pytest.mark.parametrize("source, epochs, steps, fragment", [
    ((b for b in [1]), 2, None, "one-pass iterator"),
    ([1], 0, None, "epochs must be a positive integer"),
    ([1], 1, 0, "steps_per_epoch must be a positive integer"),
])
def test_bad_arguments_are_clear_errors(source, epochs, steps, fragment):
    with pytest.raises(ps.InvalidArgumentError, match=fragment):
        ResumableBatches(source, epochs, steps, fake_context())


def test_iterating_before_an_optimizer_exists_is_refused():
    with pytest.raises(ps.NotInitializedError, match="create the paramserver optimizer before"):
        list(ResumableBatches([1], context=fake_context(optimizers=())))


def test_trainer_fit_resumes_and_steps_the_scheduler_for_skipped_epochs(fresh_context):
    ctx = ps.init()
    model = torch.nn.Linear(1, 20)
    opt = ps.optim.SGD(model.parameters(), lr=0.1)
    ctx.client.record.position = 9  # as a restarted worker learns it from the shards
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    history = ps.Trainer(model, opt, torch.nn.functional.cross_entropy, verbose=False).fit(
        shuffled_loader(), epochs=3, scheduler=schedule)
    assert [h.steps for h in history] == [0, 1, 5]  # 9 of the 15 batches were trained before
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    assert ctx.finished


def test_a_loop_that_wraps_each_epoch_on_its_own_skips_only_what_was_trained():
    ctx = fake_context(resume_step=5)
    trained = [list(ResumableBatches([1, 2, 3], context=ctx)) for _ in range(3)]
    assert trained == [[], [3], [1, 2, 3]] and ctx.finished == 3
