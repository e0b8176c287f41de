"""Server-side optimizers on float32 numpy arrays, numerically matching torch.optim.

Each optimizer updates a parameter slice in place from a gradient slice and its own
state slices. The formulas follow torch.optim's single-tensor implementations step by
step, so results agree with torch.optim to float32 rounding. Adam(W) and Adagrad run in
one fused pass from the small C library `_kernels` when it was built (about 5x faster than
numpy's dozen passes); otherwise, and for SGD, numpy works in chunks that stay in cache.

Not thread-safe: a caller serializes updates of the same arrays.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar

import numpy as np

from paramserver.base import kernels
from paramserver.base.errors import InvalidArgumentError
from paramserver.base.hyper import hyper_arguments
from paramserver.base.kernels import ptr as _ptr

log = logging.getLogger(__name__)
_CHUNK = 65536  # elements per pass: 256 KiB of float32, fits in L2 with the scratch buffers
_f32 = np.float32


class Optimizer:
    """Base of the server-side optimizers. Subclasses set `name`, `defaults`, `state_names`."""

    name: ClassVar[str]
    defaults: ClassVar[dict[str, Any]]
    state_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **hyper: Any) -> None:
        self.hyper = dict(self.defaults)
        self.hyper.update(hyper)
        self._scratch = (np.empty(_CHUNK, _f32), np.empty(_CHUNK, _f32))

    def init_state(self, size: int) -> dict[str, np.ndarray]:
        """Fresh state arrays for `size` elements."""
        return {name: np.zeros(size, _f32) for name in self.state_names}

    def set_lr(self, lr: float) -> None:
        check_lr(lr)
        self.hyper["lr"] = float(lr)

    def update(self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int) -> None:
        """Apply update number `step` (1-based) to the flat float32 slice `param` in place."""
        for lo in range(0, param.shape[0], _CHUNK):
            hi = min(lo + _CHUNK, param.shape[0])
            chunk_state = {k: v[lo:hi] for k, v in state.items()}
            tmp = tuple(s[: hi - lo] for s in self._scratch)
            self._update_chunk(param[lo:hi], grad[lo:hi], chunk_state, step, tmp)

    def _update_chunk(self, p, g, state, step, tmp) -> None:
        raise NotImplementedError

    def _decayed_grad(self, p: np.ndarray, g: np.ndarray, out: np.ndarray) -> np.ndarray:
        """g (negated if maximizing) plus L2 weight decay, as torch adds it before the update."""
        wd, maximize = self.hyper.get("weight_decay", 0.0), self.hyper.get("maximize", False)
        if not wd and not maximize:
            return g
        np.negative(g, out=out) if maximize else np.copyto(out, g)
        if wd:  # in float64, then rounded once: as torch's fused multiply-add rounds g + wd * p
            np.copyto(out, out.astype(np.float64) + wd * p.astype(np.float64), casting="same_kind")
        return out


class SGD(Optimizer):
    name = "sgd"
    defaults = {
        "lr": 1e-3,
        "momentum": 0.0,
        "dampening": 0.0,
        "weight_decay": 0.0,
        "nesterov": False,
        "maximize": False,
    }
    state_names = ("momentum_buffer",)

    def init_state(self, size: int) -> dict[str, np.ndarray]:
        return super().init_state(size) if self.hyper["momentum"] else {}

    def update(self, param: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray], step: int) -> None:
        h = self.hyper
        plain = not (h["momentum"] or h["weight_decay"] or h["maximize"])
        fits = param.flags.c_contiguous and grad.flags.c_contiguous and grad.dtype == _f32
        if plain and fits and kernels.KERNELS is not None:  # one pass: p += g * -lr
            kernels.KERNELS.ps_sgd(_ptr(param), _ptr(grad), param.shape[0], _f32(-h["lr"]))
            return
        super().update(param, grad, state, step)

    def _update_chunk(self, p, g, state, step, tmp) -> None:
        h = self.hyper
        d_p, t = self._decayed_grad(p, g, tmp[0]), tmp[1]
        if h["momentum"]:
            buf = state["momentum_buffer"]
            if step == 1:  # torch starts the buffer as a copy of the first gradient
                np.copyto(buf, d_p)
            else:
                buf *= _f32(h["momentum"])
                np.multiply(d_p, _f32(1 - h["dampening"]), out=t)
                buf += t
            if h["nesterov"]:
                np.multiply(buf, _f32(h["momentum"]), out=t)
                t += d_p
                d_p = t
            else:
                d_p = buf
        np.multiply(d_p, _f32(-h["lr"]), out=t)
        p += t


class Adagrad(Optimizer):
    name = "adagrad"
    defaults = {
        "lr": 1e-2,
        "lr_decay": 0.0,
        "weight_decay": 0.0,
        "initial_accumulator_value": 0.0,
        "eps": 1e-10,
        "maximize": False,
    }
    state_names = ("sum",)

    def init_state(self, size: int) -> dict[str, np.ndarray]:
        return {"sum": np.full(size, self.hyper["initial_accumulator_value"], _f32)}

    def update(self, param, grad, state, step) -> None:
        if kernels.KERNELS is None:
            return super().update(param, grad, state, step)
        h = self.hyper
        clr = h["lr"] / (1 + (step - 1) * h["lr_decay"])
        kernels.KERNELS.ps_adagrad(
            _ptr(param),
            _ptr(grad),
            _ptr(state["sum"]),
            param.shape[0],
            clr,
            h["eps"],
            h["weight_decay"],
            int(h["maximize"]),
        )

    def _update_chunk(self, p, g, state, step, tmp) -> None:
        h = self.hyper
        g, t = self._decayed_grad(p, g, tmp[0]), tmp[1]
        clr = h["lr"] / (1 + (step - 1) * h["lr_decay"])
        acc = state["sum"]
        np.multiply(g, g, out=t)
        acc += t
        np.sqrt(acc, out=t)
        t += _f32(h["eps"])
        np.divide(g, t, out=t)
        t *= _f32(-clr)
        p += t


class Adam(Optimizer):
    name = "adam"
    defaults = {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.0,
        "amsgrad": False,
        "maximize": False,
        "decoupled_weight_decay": False,
    }

    @property
    def state_names(self) -> tuple[str, ...]:  # type: ignore[override]
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if self.hyper["amsgrad"] else ())

    def update(self, param, grad, state, step) -> None:
        if kernels.KERNELS is None:
            return super().update(param, grad, state, step)
        h = self.hyper
        beta1, beta2 = h["betas"]
        kernels.KERNELS.ps_adam(
            _ptr(param),
            _ptr(grad),
            _ptr(state["exp_avg"]),
            _ptr(state["exp_avg_sq"]),
            _ptr(state.get("max_exp_avg_sq")),
            param.shape[0],
            1 - beta1,
            beta2,
            1 - beta2,
            h["lr"] / (1 - beta1**step),
            math.sqrt(1 - beta2**step),
            h["eps"],
            h["weight_decay"],
            1 - h["lr"] * h["weight_decay"],
            int(h["decoupled_weight_decay"]),
            int(h["amsgrad"]),
            int(h["maximize"]),
        )

    def _decayed_grad(self, p, g, out):
        if self.hyper["decoupled_weight_decay"]:  # AdamW decays the parameter, not the gradient
            if self.hyper["weight_decay"]:
                p *= _f32(1 - self.hyper["lr"] * self.hyper["weight_decay"])
            if self.hyper["maximize"]:
                return np.negative(g, out=out)
            return g
        return super()._decayed_grad(p, g, out)

    def _update_chunk(self, p, g, state, step, tmp) -> None:
        h = self.hyper
        beta1, beta2 = h["betas"]
        g = self._decayed_grad(p, g, tmp[0])
        m, v, t = state["exp_avg"], state["exp_avg_sq"], tmp[1]
        np.subtract(g, m, out=t)  # m.lerp_(g, 1 - beta1)
        t *= _f32(1 - beta1)
        m += t
        v *= _f32(beta2)  # v.mul_(beta2).addcmul_(g, g, 1 - beta2)
        np.multiply(g, g, out=t)
        t *= _f32(1 - beta2)
        v += t
        if h["amsgrad"]:
            np.maximum(state["max_exp_avg_sq"], v, out=state["max_exp_avg_sq"])
            v = state["max_exp_avg_sq"]
        step_size = h["lr"] / (1 - beta1**step)
        np.sqrt(v, out=t)
        t /= _f32(math.sqrt(1 - beta2**step))
        t += _f32(h["eps"])
        np.divide(m, t, out=t)
        t *= _f32(-step_size)
        p += t


class AdamW(Adam):
    name = "adamw"
    defaults = {**Adam.defaults, "weight_decay": 1e-2, "decoupled_weight_decay": True}


OPTIMIZERS: dict[str, type[Optimizer]] = {cls.name: cls for cls in (SGD, Adagrad, Adam, AdamW)}
# torch.optim arguments that choose an implementation, not the math. foreach and fused only
# choose how torch loops (the PS runs its own fused kernels), so they are accepted and ignored;
# the other two ask for something a PS update cannot be, so they are refused.
_IGNORED_IMPLEMENTATION_ARGS = frozenset({"foreach", "fused"})
_REFUSED_IMPLEMENTATION_ARGS = {
    "differentiable": "the PS applies updates outside autograd, so a step cannot be differentiated through",
    "capturable": "it is for CUDA graph capture, and a PS step runs on the PS, outside any graph",
}


def check_implementation(name: str, args: dict[str, Any]) -> None:
    """Refuse implementation switches a PS optimizer cannot honour, naming the switch and why."""
    for key, why in _REFUSED_IMPLEMENTATION_ARGS.items():
        if args.get(key):
            raise InvalidArgumentError(f"{name}: {key}=True is not supported: {why}")
    if args.get("foreach") and args.get("fused"):
        raise InvalidArgumentError(f"{name}: `fused` and `foreach` cannot be `True` together")


def build_optimizer(spec: dict[str, Any]) -> Optimizer:
    """Build an optimizer from {"name": ..., "hyper": {...}}, validating like torch.optim does."""
    if not isinstance(spec, dict) or spec.get("name") not in OPTIMIZERS:
        raise InvalidArgumentError(
            f"unknown optimizer {spec.get('name') if isinstance(spec, dict) else spec!r}; known: {sorted(OPTIMIZERS)}"
        )
    cls = OPTIMIZERS[spec["name"]]
    hyper = hyper_arguments(cls.name, spec, cls.defaults)
    check_implementation(cls.name, hyper)
    hyper = {
        k: v for k, v in hyper.items() if k not in _IGNORED_IMPLEMENTATION_ARGS | set(_REFUSED_IMPLEMENTATION_ARGS)
    }
    unknown = sorted(set(hyper) - set(cls.defaults))
    if unknown:
        raise InvalidArgumentError(f"{cls.name}: unknown arguments {unknown}; known: {sorted(cls.defaults)}")
    optimizer = cls(**hyper)
    _validate(optimizer.hyper, cls.name)
    return optimizer


def _check_range(name: str, value: Any, low: float, high: float = math.inf, high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and low <= value and (value < high if high_open else value <= high)
    if not ok:
        raise InvalidArgumentError(f"invalid {name}: {value!r} (must be a finite number in [{low}, {high}])")


def check_lr(lr: Any) -> None:
    """Raise InvalidArgumentError unless `lr` is a finite non-negative number."""
    _check_range("lr", lr, 0.0)


def _validate(h: dict[str, Any], name: str) -> None:
    _check_range("lr", h["lr"], 0.0)
    _check_range("weight_decay", h["weight_decay"], 0.0)
    for key in ("eps", "momentum", "dampening", "lr_decay", "initial_accumulator_value"):
        if key in h:
            _check_range(key, h[key], 0.0)
    if "betas" in h:
        betas = h["betas"]
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
            raise InvalidArgumentError(f"{name}: betas must be a pair, got {betas!r}")
        for i, beta in enumerate(betas):
            _check_range(f"beta parameter at index {i}", beta, 0.0, 1.0, high_open=True)
        h["betas"] = (float(betas[0]), float(betas[1]))
    if h.get("nesterov") and (h["momentum"] <= 0 or h["dampening"] != 0):
        raise InvalidArgumentError("sgd: nesterov momentum requires a momentum and zero dampening")
