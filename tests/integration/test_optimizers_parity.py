"""Server-side optimizers against torch.optim: same init, same data, 100 steps, within 1e-5 relative."""

import pytest
import torch
from tests.reference import batches, max_relative_error, mlp, train, twin

import paramserver as ps
from paramserver.base import kernels

CASES = [
    ("SGD", dict(lr=0.05)),
    ("SGD", dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    ("SGD", dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("SGD", dict(lr=1e-4, momentum=0.5, dampening=0.1, maximize=True)),
    ("Adagrad", dict(lr=0.05, lr_decay=1e-3, weight_decay=1e-3, initial_accumulator_value=0.1)),
    ("Adam", dict(lr=1e-3)),
    ("Adam", dict(lr=1e-3, weight_decay=1e-2, amsgrad=True)),
    ("AdamW", dict(lr=1e-3, betas=(0.8, 0.99))),
]


@pytest.mark.parity  # 16 trainings of 100 steps on both sides: about a minute
@pytest.mark.parametrize("name, kwargs", CASES)
@pytest.mark.parametrize("path", ["fused", "numpy"])
def test_matches_torch_optim_after_100_steps(name, kwargs, path, monkeypatch, fresh_context):
    if path == "numpy":
        monkeypatch.setattr(kernels, "KERNELS", None)
    elif kernels.KERNELS is None:
        pytest.skip("fused kernels not built")
    ps.init(num_ps=3)
    reference = mlp()
    model = twin(reference)
    data = batches(100)
    train(reference, getattr(torch.optim, name)(reference.parameters(), **kwargs), data)
    train(model, getattr(ps.optim, name)(model.named_parameters(), **kwargs), data)
    assert max_relative_error(model, reference) < 1e-5
