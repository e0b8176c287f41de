"""The Trainer with a bfloat16 model and the PS in this process: float32 batches are cast to the model's
dtype, and it learns. Models in bfloat16 and float16 against torch on real PS processes:
tests/integration/test_mixed_precision.py."""

import torch
import torch.nn.functional as F
from tests.reference import mlp
from torch.utils.data import DataLoader, TensorDataset

import paramserver as ps


def test_the_trainer_casts_float32_batches_for_a_bfloat16_model_which_learns(fresh_context):
    ps.init(num_ps=1)
    x = torch.randn(256, 784, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=32)
    model = mlp(sizes=(784, 32, 2)).to(torch.bfloat16)
    trainer = ps.Trainer(model, ps.optim.Adam(model.parameters(), lr=1e-2), F.cross_entropy, verbose=False)
    history = trainer.fit(loader, epochs=3, steps_per_epoch=5)
    assert history[-1].loss < history[0].loss
    assert trainer.evaluate(loader)["accuracy"] > 0.8
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
