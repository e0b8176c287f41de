"""The batch shapes `Trainer.fit` and `Trainer.evaluate` take, each trained against plain torch."""

import pytest
import torch
import torch.nn.functional as F

import paramserver as ps

DIM = 4


class TwoInputs(torch.nn.Module):
    """A dense input and a table's ids: the shape of a CTR model."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(3 + DIM, 1)
        self.emb = ps.nn.HashEmbedding(DIM, std=0.1)

    def forward(self, dense, ids):
        return self.fc(torch.cat([dense, self.emb(ids)], dim=1)).squeeze(1)


def batches(steps=6):
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(8, 3, generator=g), torch.randint(0, 30, (8,), generator=g), torch.randn(8, generator=g))
        for _ in range(steps)
    ]


def shaped(kind, dense, ids, y):
    if kind == "flat":
        return (dense, ids, y)
    if kind == "nested":
        return ((dense, ids), y)
    if kind == "list":
        return [[dense, ids], y]
    return ({"dense": dense, "ids": ids}, y)


def by_hand(steps):
    """What a plain loop over the same batches trains, in a cluster of its own: the reference
    (embedding rows of ids 0..29, fc.weight)."""
    ctx = ps.init(num_ps=2)
    model = TwoInputs()
    opt = ps.optim.SGD(model.named_parameters(), lr=0.1)
    for dense, ids, y in steps:
        opt.zero_grad()
        F.mse_loss(model(dense, ids), y).backward()
        opt.step()
    opt.pull()
    trained = model.emb(torch.arange(30)).detach(), model.fc.weight.detach().clone()
    ctx.shutdown()
    return trained


@pytest.mark.parametrize("kind", ["flat", "nested", "list", "dict"])
def test_a_multi_input_model_trains_from_each_batch_shape_as_a_plain_loop_does(kind, fresh_context):
    data = batches()
    rows, weight = by_hand(data)
    ps.init(num_ps=2)
    model = TwoInputs()
    opt = ps.optim.SGD(model.named_parameters(), lr=0.1)
    history = ps.Trainer(model, opt, F.mse_loss, verbose=False).fit([shaped(kind, *b) for b in data])
    assert history[0].steps == len(data) and history[0].examples == 8 * len(data)
    opt.pull()
    # the same updates on the same values, in another run's tables: bit for bit
    assert torch.equal(model.emb(torch.arange(30)), rows)
    assert torch.equal(model.fc.weight, weight)
    metrics = ps.Trainer(model, opt, F.mse_loss, verbose=False).evaluate([shaped(kind, *b) for b in data[:2]])
    assert metrics["examples"] == 16 and metrics["loss"] > 0


def test_a_single_input_batch_still_calls_model_x(fresh_context):
    ps.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 3)
    seen = []
    model.register_forward_pre_hook(lambda _, args: seen.append(len(args)))
    opt = ps.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(4, 2), torch.randint(0, 3, (4,))) for _ in range(3)]
    history = ps.Trainer(model, opt, F.cross_entropy, verbose=False).fit(data)
    assert history[0].steps == 3 and history[0].examples == 12 and seen == [1, 1, 1]


@pytest.mark.parametrize("batch", [torch.zeros(4, 2), (torch.zeros(4),), 7])
def test_a_batch_without_inputs_and_target_is_refused_by_name(batch, fresh_context):
    ps.init()
    model = torch.nn.Linear(2, 1)
    opt = ps.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    with pytest.raises(ps.InvalidArgumentError, match="batches of \\(inputs..., target\\)"):
        ps.Trainer(model, opt, F.mse_loss, verbose=False).fit([batch])
    assert torch.equal(model.weight, before)
