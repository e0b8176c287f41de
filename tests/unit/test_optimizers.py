"""Server-side optimizers against torch.optim, same init and data, within 1e-5 relative: parameters without
a gradient, schedulers, param groups, a second worker. The 100-step matrix of optimizers is
tests/integration/test_optimizers_parity.py."""

import dataclasses

import pytest
import torch
from tests.reference import batches, max_relative_error, mlp, train, twin

import paramserver as ps
from paramserver.client.ps_client import PSClient


def test_parameters_without_gradient_are_left_alone_like_torch(fresh_context):
    ps.init(num_ps=2)
    reference = mlp(sizes=(784, 64, 10))
    extra = torch.nn.Linear(3, 3)  # never used in forward: its .grad stays None
    model, extra_twin = twin(reference), twin(extra)
    params_ref = list(reference.parameters()) + list(extra.parameters())
    params_ps = list(model.parameters()) + list(extra_twin.parameters())
    data = batches(20)
    train(reference, torch.optim.Adam(params_ref, lr=1e-2), data)
    train(model, ps.optim.Adam(params_ps, lr=1e-2), data)
    assert max_relative_error(model, reference) < 1e-5
    assert torch.equal(extra_twin.weight, extra.weight)


def test_lr_scheduler_changes_reach_the_ps(fresh_context):
    ps.init(num_ps=2)
    reference = mlp()
    model = twin(reference)
    data = batches(30)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt_ps = ps.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(reference, opt_ref, data, torch.optim.lr_scheduler.StepLR(opt_ref, step_size=10, gamma=0.1))
    train(model, opt_ps, data, torch.optim.lr_scheduler.StepLR(opt_ps, step_size=10, gamma=0.1))
    assert max_relative_error(model, reference) < 1e-5


def test_param_groups_keep_their_own_hyperparameters(fresh_context):
    ps.init(num_ps=2)
    reference = mlp(sizes=(784, 32, 10))
    model = twin(reference)
    data = batches(30)

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 1e-2}, {"params": m[2].parameters()}]
    train(reference, torch.optim.Adam(groups(reference), lr=1e-3), data)
    train(model, ps.optim.Adam(groups(model), lr=1e-3), data)
    assert max_relative_error(model, reference) < 1e-5


def test_second_worker_adopts_the_first_workers_initial_values(fresh_context):
    ctx = ps.init(num_ps=2)
    other = dataclasses.replace(ctx, worker_index=1, client=PSClient(ctx.client.channels, 10.0), optimizers=[])
    first, second = mlp(seed=0), mlp(seed=1)
    ps.optim.Adam(first.parameters(), context=ctx)
    ps.optim.Adam(second.parameters(), context=other)
    assert max_relative_error(second, first) == 0.0


@pytest.mark.parametrize("name, kwargs, fragment", [
    ("Adam", dict(lr=-1.0), "invalid lr"),
    ("Adam", dict(betas=(1.0, 0.999)), "beta parameter at index 0"),
    ("SGD", dict(lr=0.1, nesterov=True), "nesterov"),
    ("Adagrad", dict(eps=float("nan")), "invalid eps"),
])
def test_bad_arguments_are_refused_before_reaching_a_ps(name, kwargs, fragment, fresh_context):
    ctx = ps.init(num_ps=1)
    with pytest.raises(ps.InvalidArgumentError, match=fragment):
        getattr(ps.optim, name)(mlp().parameters(), **kwargs)
    assert ctx.client.parts_of == {}


def test_optimizer_before_init_is_a_clear_error(fresh_context):
    with pytest.raises(ps.NotInitializedError, match="paramserver.init"):
        ps.optim.SGD(mlp().parameters(), lr=0.1)
