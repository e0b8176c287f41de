"""torch's own optimizer configuration matrix (optim_db, shipped with torch) against paramserver.optim.

Each configuration of SGD, Adagrad, Adam and AdamW on CPU/float32 either trains to torch.optim's
values (within 1e-5 relative of one of torch's implementations, or within the spread between them)
or is refused before anything is registered, with a message naming the option.
"""

import pytest
import torch
from tests.reference import batches, max_relative_error, mlp, train, twin

import paramserver as ps

pytestmark = pytest.mark.parity  # torch's whole optim_db matrix, trained on both sides

NAMES = ("SGD", "Adagrad", "Adam", "AdamW")
SIZES, STEPS = (32, 16, 10), 30


def _matrix() -> list:
    try:  # a private module of torch's own tests: it may move between releases
        from torch.testing._internal.common_optimizers import (
            _get_optim_inputs_including_global_cliquey_kwargs as configs,
        )
        from torch.testing._internal.common_optimizers import optim_db
    except Exception as exc:
        return [pytest.param(None, None, marks=pytest.mark.skip(reason=f"torch's optim_db unavailable: {exc}"))]
    return [pytest.param(info.optim_cls.__name__, config.kwargs, id=f"{info.optim_cls.__name__}-{config.desc}")
            for info in optim_db if info.optim_cls.__name__ in NAMES
            for config in configs("cpu", torch.float32, info)]


MATRIX = _matrix()


def _torch_run(name: str, kwargs: dict, reference) -> torch.nn.Module:
    model = twin(reference)
    train(model, getattr(torch.optim, name)(model.parameters(), **kwargs), batches(STEPS, features=SIZES[0]))
    return model


def _spread(name: str, kwargs: dict, reference) -> tuple[list, float]:
    """torch's implementations of this configuration (single-tensor, fused) and how far apart they are."""
    plain = {**kwargs, "fused": False, "foreach": False}
    runs = [_torch_run(name, plain, reference), _torch_run(name, {**plain, "fused": True}, reference)]
    return runs, max_relative_error(runs[0], runs[1])


@pytest.mark.parametrize("name, kwargs", MATRIX)
def test_every_optim_db_configuration_equals_torch_or_is_refused(name, kwargs, fresh_context):
    ps.init(num_ps=2)
    reference = mlp(sizes=SIZES)
    if kwargs.get("differentiable"):
        with pytest.raises(ValueError, match="differentiable=True is not supported"):
            getattr(ps.optim, name)(twin(reference).parameters(), **kwargs)
        assert all(stats["version"] == 0 for stats in ps.current_context().shard_stats())
        return
    model = twin(reference)
    train(model, getattr(ps.optim, name)(model.parameters(), **kwargs), batches(STEPS, features=SIZES[0]))
    runs, spread = _spread(name, kwargs, reference)
    errors = [max_relative_error(model, run) for run in runs]
    assert min(errors) <= 1e-5 or max(errors) <= spread, f"errors {errors}, torch's own spread {spread}"


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_capturable_is_refused_before_anything_is_registered(name, fresh_context):
    ps.init(num_ps=2)
    model = mlp(sizes=SIZES)
    with pytest.raises(ps.InvalidArgumentError, match="capturable=True is not supported"):
        getattr(ps.optim, name)(model.parameters(), capturable=True)
    # the refused optimizer left nothing: the same group registers afresh with other hyper-parameters
    reference = twin(model)
    train(model, getattr(ps.optim, name)(model.parameters(), lr=0.02), batches(5, features=SIZES[0]))
    train(reference, getattr(torch.optim, name)(reference.parameters(), lr=0.02), batches(5, features=SIZES[0]))
    assert max_relative_error(model, reference) < 1e-5


def test_tensor_hyper_parameters_work_and_follow_a_scheduler(fresh_context):
    ps.init(num_ps=2)
    reference = mlp(sizes=SIZES)
    model = twin(reference)
    kwargs = lambda: dict(lr=torch.tensor(0.01), betas=(torch.tensor(0.8), torch.tensor(0.99)))
    opt_ps, opt_torch = ps.optim.Adam(model.parameters(), **kwargs()), torch.optim.Adam(reference.parameters(), **kwargs())
    data = batches(20, features=SIZES[0])
    train(model, opt_ps, data, torch.optim.lr_scheduler.StepLR(opt_ps, step_size=5, gamma=0.5))
    train(reference, opt_torch, data, torch.optim.lr_scheduler.StepLR(opt_torch, step_size=5, gamma=0.5))
    assert max_relative_error(model, reference) < 1e-5


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(lr=torch.tensor([0.1, 0.2])), "Tensor lr must be 1-element"),
    (dict(foreach=True, fused=True), "cannot be `True` together"),
    (dict(lr=-1.0), "invalid lr"),
])
def test_bad_arguments_are_value_errors_naming_the_option(kwargs, fragment, fresh_context):
    ps.init()
    with pytest.raises(ValueError, match=fragment):
        ps.optim.Adam(mlp(sizes=SIZES).parameters(), **kwargs)
