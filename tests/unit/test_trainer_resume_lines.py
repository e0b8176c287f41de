"""`Trainer.fit` after a restart: the epochs trained before it are one line, not `loss=0.0000 steps=0`."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import paramserver as ps


@pytest.mark.parametrize(
    "position, expected",
    [
        (0, ["epoch 1/3: ", "epoch 2/3: ", "epoch 3/3: "]),
        (4, ["epoch 1/3: loss=", "epoch 2/3: ", "epoch 3/3: "]),  # part of epoch 1 trained: still printed
        (5, ["epoch 1/3 done before the resume", "epoch 2/3: ", "epoch 3/3: "]),
        (11, ["epochs 1-2/3 done before the resume", "epoch 3/3: loss="]),
        (15, ["epochs 1-3/3 done before the resume"]),
    ],
)
def test_epochs_trained_before_a_restart_are_one_line(fresh_context, capsys, position, expected):
    ctx = ps.init()
    model = torch.nn.Linear(1, 20)
    opt = ps.optim.SGD(model.parameters(), lr=0.1)
    ctx.client.record.position = position  # as a restarted worker learns it from the shards
    loader = DataLoader(TensorDataset(torch.arange(20).float().unsqueeze(1), torch.arange(20)), batch_size=4)
    history = ps.Trainer(model, opt, torch.nn.functional.cross_entropy).fit(loader, epochs=3)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")]
    assert len(lines) == len(expected) and all(line.startswith(e) for line, e in zip(lines, expected)), lines
    assert "steps=0" not in "\n".join(lines)
    assert [h.steps for h in history] == [max(0, min(5, 5 * (e + 1) - position)) for e in range(3)]
