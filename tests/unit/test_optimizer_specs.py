"""Optimizer defaults have one source (base/optimizer_specs.py): the PS applies them, the worker's
classes offer them, and they are torch.optim's where the math is torch's."""

import ast
import inspect
from pathlib import Path

import pytest
import torch

import paramserver as ps
from paramserver.base.errors import InvalidArgumentError
from paramserver.base.optimizer_specs import DENSE, SPARSE
from paramserver.server.optimizers import OPTIMIZERS, build_optimizer
from paramserver.tables.sparse_optimizers import SPARSE_OPTIMIZERS, build_sparse_optimizer

CLASSES = {"sgd": "SGD", "adagrad": "Adagrad", "adam": "Adam", "adamw": "AdamW"}
# the worker's own arguments, beside torch's
WORKER_ONLY = {"overlap", "context"}


def _defaults(function) -> dict:
    return {
        name: param.default
        for name, param in inspect.signature(function).parameters.items()
        if param.default is not inspect.Parameter.empty
    }


def test_every_optimizer_has_a_spec_a_ps_class_and_a_worker_class():
    assert set(OPTIMIZERS) == set(DENSE) == set(CLASSES)
    assert set(SPARSE_OPTIMIZERS) == set(SPARSE)


@pytest.mark.parametrize("kind", sorted(DENSE))
def test_the_ps_applies_the_spec_defaults(kind):
    assert build_optimizer({"name": kind}).hyper == dict(DENSE[kind].defaults)


@pytest.mark.parametrize("kind", sorted(SPARSE))
def test_a_table_applies_the_spec_defaults(kind):
    assert build_sparse_optimizer({"name": kind}).hyper == dict(SPARSE[kind].defaults)


@pytest.mark.parametrize("kind", sorted(DENSE))
def test_the_worker_classes_offer_the_spec_defaults(kind):
    offered = _defaults(getattr(ps.optim, CLASSES[kind]))
    spec = DENSE[kind].defaults
    # AdamW decouples its weight decay always: torch's AdamW has no switch for it, nor has ours
    expected = {name: value for name, value in spec.items() if not (kind == "adamw" and name.startswith("decoupled"))}
    assert {name: offered[name] for name in expected} == expected


@pytest.mark.parametrize("kind", sorted(DENSE))
def test_the_worker_classes_take_torch_optim_arguments_with_torch_defaults(kind):
    ours, theirs = getattr(ps.optim, CLASSES[kind]), getattr(torch.optim, CLASSES[kind])
    ours_params, theirs_params = inspect.signature(ours).parameters, inspect.signature(theirs).parameters
    assert set(ours_params) - WORKER_ONLY == set(theirs_params)
    positional = [name for name, param in theirs_params.items() if param.kind is param.POSITIONAL_OR_KEYWORD]
    assert [name for name, param in ours_params.items() if param.kind is param.POSITIONAL_OR_KEYWORD] == positional
    torch_defaults = _defaults(theirs)
    assert {name: _defaults(ours)[name] for name in torch_defaults} == torch_defaults
    assert {name: DENSE[kind].defaults[name] for name in DENSE[kind].defaults.keys() & torch_defaults} == {
        name: torch_defaults[name] for name in DENSE[kind].defaults.keys() & torch_defaults
    }


def test_row_wise_defaults_are_torch_sparse_ones_where_torch_has_the_optimizer():
    torch_sparse_adam = _defaults(torch.optim.SparseAdam)
    assert {k: SPARSE["adam"].defaults[k] for k in torch_sparse_adam} == torch_sparse_adam
    for kind in ("sgd", "adagrad"):  # torch trains nn.Embedding(sparse=True) with its dense SGD, Adagrad
        torch_defaults = _defaults(getattr(torch.optim, CLASSES[kind]))
        assert {k: torch_defaults[k] for k in SPARSE[kind].defaults} == dict(SPARSE[kind].defaults)


@pytest.mark.parametrize("spec, fragment", [
    ({"name": "adam", "hyper": {"lr": -1.0}}, "adam: invalid lr"),
    ({"name": "adamw", "hyper": {"betas": [0.9, 1.0]}}, "beta parameter at index 1"),
    ({"name": "sgd", "hyper": {"nesterov": True}}, "nesterov momentum requires"),
    ({"name": "sgd", "hyper": {"capturable": True}}, "capturable=True is not supported"),
    ({"name": "sgd", "hyper": {"per_row_step": True}}, r"sgd: unknown arguments \['per_row_step'\]"),
    ({"name": "rmsprop"}, "unknown optimizer 'rmsprop'"),
])
def test_the_ps_refuses_arguments_torch_refuses(spec, fragment):
    with pytest.raises(InvalidArgumentError, match=fragment):
        build_optimizer(spec)


def test_a_flag_given_as_0_or_1_and_a_pair_as_a_list_are_taken_as_torch_takes_them():
    assert build_optimizer({"name": "adam", "hyper": {"amsgrad": 1, "betas": [0.5, 0.6]}}).hyper["betas"] == (0.5, 0.6)


def test_the_worker_side_imports_nothing_of_the_ps():
    root = Path(ps.__file__).parent
    for package in ("optim", "nn", "serving", "evaluation", "worker"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                assert not any(name.startswith("paramserver.server") for name in names), path
