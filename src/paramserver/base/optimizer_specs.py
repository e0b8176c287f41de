"""Each optimizer's arguments, once: their names, defaults, kinds and ranges.

The worker's optimizer classes (optim/ps_optimizers.py) take their defaults from here, the PS's
dense optimizers (server/optimizers.py) and the tables' row-wise ones (tables/sparse_optimizers.py)
check what a peer sends against the same table. Defaults are torch.optim's where torch has the
optimizer (SGD, Adagrad, Adam, AdamW; row-wise Adam is torch.optim.SparseAdam's, with
`per_row_step`); FTRL's are TensorFlow's Ftrl's.

A peer's {"name": ..., "hyper": {...}} is data: `hyper` must be an object, each argument must be
known and have its default's kind (a number for a number, true/false (or 0/1) for a flag, a pair
of numbers for a pair), and the arguments torch.optim checks must be in torch's range; anything
else is an InvalidArgumentError naming the optimizer and the argument.

Read-only tables and pure functions: thread-safe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from paramserver.base.errors import InvalidArgumentError

# torch.optim arguments that choose an implementation, not the math. foreach and fused only
# choose how torch loops (the PS runs its own fused kernels), so they are accepted and ignored;
# the other two ask for something a PS update cannot be, so they are refused.
IGNORED_IMPLEMENTATION_ARGS = frozenset({"foreach", "fused"})
REFUSED_IMPLEMENTATION_ARGS = MappingProxyType(
    {
        "differentiable": "the PS applies updates outside autograd, so a step cannot be differentiated through",
        "capturable": "it is for CUDA graph capture, and a PS step runs on the PS, outside any graph",
    }
)
_SWITCHES = IGNORED_IMPLEMENTATION_ARGS | set(REFUSED_IMPLEMENTATION_ARGS)
_FLAG, _NUMBER, _PAIR = "true or false", "a number", "a pair of numbers"


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer: `name` (as the wire names it), `owner` (as errors name it), `defaults`
    (every argument it takes, in torch's order), `nonnegative` (the arguments that must be finite
    and >= 0), `unit_pairs` (pairs each of whose numbers must be in [0, 1)), `switches` (whether it
    takes torch's implementation switches: foreach, fused, capturable, differentiable)."""

    name: str
    owner: str
    defaults: Mapping[str, Any]
    nonnegative: tuple[str, ...] = ("lr",)
    unit_pairs: tuple[str, ...] = ()
    switches: bool = False

    def arguments(self, hyper: Any) -> dict[str, Any]:
        """The complete arguments (defaults filled in) of a peer's `hyper`, checked; changes nothing."""
        if not isinstance(hyper, dict):
            raise InvalidArgumentError(
                f"{self.owner}: hyper must be an object of arguments, got {type(hyper).__name__}"
            )
        for key, value in hyper.items():
            want = _kind(self.defaults.get(key))
            if want is not None and not _is(value, want):
                raise InvalidArgumentError(f"{self.owner}: argument {key!r} must be {want}, got {str(value)[:40]!r}")
        if self.switches:
            check_implementation(self.owner, hyper)
            hyper = {key: value for key, value in hyper.items() if key not in _SWITCHES}
        unknown = sorted(set(hyper) - set(self.defaults))
        if unknown:
            raise InvalidArgumentError(f"{self.owner}: unknown arguments {unknown}; known: {sorted(self.defaults)}")
        args = {**self.defaults, **hyper}
        for key in self.nonnegative:
            if key in args:
                _check_range(self.owner, key, args[key], 0.0)
        for key in self.unit_pairs:
            args[key] = _unit_pair(self.owner, key, args[key])
        if args.get("nesterov") and (args["momentum"] <= 0 or args["dampening"] != 0):
            raise InvalidArgumentError(f"{self.owner}: nesterov momentum requires a momentum and zero dampening")
        return args


def _dense(name: str, defaults: dict[str, Any], nonnegative: tuple[str, ...], **checks: Any) -> OptimizerSpec:
    return OptimizerSpec(name, name, MappingProxyType(defaults), nonnegative, switches=True, **checks)


def _sparse(name: str, defaults: dict[str, Any]) -> OptimizerSpec:
    return OptimizerSpec(name, f"sparse {name}", MappingProxyType(defaults))


_ADAM = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.0,
    "amsgrad": False,
    "maximize": False,
    "decoupled_weight_decay": False,
}
_ADAM_RANGES = ("lr", "eps", "weight_decay")

# the PS's dense optimizers, as torch.optim has them
DENSE: Mapping[str, OptimizerSpec] = MappingProxyType(
    {
        "sgd": _dense(
            "sgd",
            {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0, "nesterov": False, "maximize": False},
            ("lr", "momentum", "dampening", "weight_decay"),
        ),
        "adagrad": _dense(
            "adagrad",
            {
                "lr": 1e-2,
                "lr_decay": 0.0,
                "weight_decay": 0.0,
                "initial_accumulator_value": 0.0,
                "eps": 1e-10,
                "maximize": False,
            },
            ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"),
        ),
        "adam": _dense("adam", _ADAM, _ADAM_RANGES, unit_pairs=("betas",)),
        # torch's AdamW is its Adam with decoupled weight decay, and a larger weight decay by default
        "adamw": _dense(
            "adamw",
            {**_ADAM, "weight_decay": 1e-2, "decoupled_weight_decay": True},
            _ADAM_RANGES,
            unit_pairs=("betas",),
        ),
    }
)

# the tables' row-wise optimizers (a table's spec). Only lr is range-checked, as it always was:
# the spec of a saved table must keep loading.
SPARSE: Mapping[str, OptimizerSpec] = MappingProxyType(
    {
        "sgd": _sparse("sgd", {"lr": 1e-3, "maximize": False}),
        "adagrad": _sparse(
            "adagrad", {"lr": 1e-2, "lr_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10, "maximize": False}
        ),
        "adam": _sparse(
            "adam", {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "per_row_step": False, "maximize": False}
        ),
        "ftrl": _sparse("ftrl", {"lr": 0.05, "beta": 1.0, "l1": 0.0, "l2": 0.0, "initial_accumulator_value": 0.1}),
    }
)


def dense_spec(spec: Any) -> OptimizerSpec:
    """The dense optimizer a peer's {"name": ..., "hyper": ...} names; InvalidArgumentError if none."""
    name = spec.get("name") if isinstance(spec, dict) else spec
    if not isinstance(name, str) or name not in DENSE:
        raise InvalidArgumentError(f"unknown optimizer {name!r}; known: {sorted(DENSE)}")
    return DENSE[name]


def sparse_spec(spec: Any) -> OptimizerSpec:
    """The row-wise optimizer a table's {"name": ..., "hyper": ...} names; InvalidArgumentError if none."""
    name = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str) or name not in SPARSE:
        raise InvalidArgumentError(f"unknown sparse optimizer {name!r}; known: {sorted(SPARSE)}")
    return SPARSE[name]


def check_implementation(owner: str, args: Mapping[str, Any]) -> None:
    """Refuse implementation switches a PS optimizer cannot honour, naming the switch and why."""
    for key, why in REFUSED_IMPLEMENTATION_ARGS.items():
        if args.get(key):
            raise InvalidArgumentError(f"{owner}: {key}=True is not supported: {why}")
    if args.get("foreach") and args.get("fused"):
        raise InvalidArgumentError(f"{owner}: `fused` and `foreach` cannot be `True` together")


def check_lr(lr: Any) -> None:
    """Raise InvalidArgumentError unless `lr` is a finite non-negative number."""
    _check_range("", "lr", lr, 0.0)


def _check_range(
    owner: str, name: str, value: Any, low: float, high: float = math.inf, high_open: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and low <= value and (value < high if high_open else value <= high)
    if not ok:
        where = f"{owner}: " if owner else ""
        raise InvalidArgumentError(f"{where}invalid {name}: {value!r} (must be a finite number in [{low}, {high}])")


def _unit_pair(owner: str, name: str, pair: Any) -> tuple[float, float]:
    if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
        raise InvalidArgumentError(f"{owner}: {name} must be a pair, got {pair!r}")
    for i, value in enumerate(pair):
        _check_range(owner, f"beta parameter at index {i}", value, 0.0, 1.0, high_open=True)
    return float(pair[0]), float(pair[1])


def _kind(default: Any) -> str | None:
    if isinstance(default, bool):
        return _FLAG
    if isinstance(default, (int, float)):
        return _NUMBER
    if isinstance(default, tuple):
        return _PAIR
    return None  # not an argument of this optimizer: the unknown-argument check names it


def _is(value: Any, want: str) -> bool:
    if want == _FLAG:
        return isinstance(value, (bool, int))  # torch.optim takes 0 and 1 for a flag too
    if want == _NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, (list, tuple)) and all(_is(item, _NUMBER) for item in value)
