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
from paramserver.base.kernels import ptr as _ptr
from paramserver.base.optimizer_specs import DENSE, OptimizerSpec, check_lr, dense_spec

log = logging.getLogger(__name__)
_CHUNK = 65536  # elements per pass: 256 KiB of float32, fits in L2 with the scratch buffers
_f32 = np.float32


class Optimizer:
    """Base of the server-side optimizers. Subclasses set `spec` (their arguments, from
    base/optimizer_specs.py) and `state_names`. The constructor takes arguments as checked by
    `spec.arguments` (build_optimizer checks them); the ones not given take their defaults."""

    spec: ClassVar[OptimizerSpec]
    state_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **hyper: Any) -> None:
        self.hyper = {**self.spec.defaults, **hyper}
        self._scratch = (np.empty(_CHUNK, _f32), np.empty(_CHUNK, _f32))

    @property
    def name(self) -> str:
        return self.spec.name

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
    spec = DENSE["sgd"]
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
    spec = DENSE["adagrad"]
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
    spec = DENSE["adam"]

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
    spec = DENSE["adamw"]


OPTIMIZERS: dict[str, type[Optimizer]] = {cls.spec.name: cls for cls in (SGD, Adagrad, Adam, AdamW)}


def build_optimizer(spec: dict[str, Any]) -> Optimizer:
    """Build an optimizer from {"name": ..., "hyper": {...}}, its arguments checked as torch.optim
    checks them (base/optimizer_specs.py); InvalidArgumentError naming what is wrong otherwise."""
    found = dense_spec(spec)
    return OPTIMIZERS[found.name](**found.arguments(spec.get("hyper", {})))
