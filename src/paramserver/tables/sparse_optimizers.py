"""Row-wise optimizers for embedding tables: only the rows a push touches are updated.

Each follows torch.optim's sparse path where torch has one (SGD, Adagrad, SparseAdam), so a
table trained here equals `nn.Embedding(sparse=True)` trained by torch; FTRL-Proximal follows
McMahan et al. (2013), as TensorFlow's Ftrl does with learning_rate_power -0.5.
`step` counts the table's updates: every push of a worker counts on every shard, also on one that
got no row of it, so that the count is torch's (per parameter, not per row) for any number of
shards; Adam with
`per_row_step=True` counts per row instead (lazy Adam whose bias correction follows each row).
Sparse Adagrad and Adam (table steps) run as one C loop over the rows when the kernels
were built (paramserver.base.kernels), with the same formulas.
Not thread-safe: the owning table serializes calls.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from paramserver.base import kernels
from paramserver.base.kernels import ptr
from paramserver.base.optimizer_specs import SPARSE, OptimizerSpec, sparse_spec


def _fits(values: np.ndarray, rows: np.ndarray, grads: np.ndarray) -> bool:
    """Whether the C kernels can take these arrays as they are (C-contiguous, the expected dtypes)."""
    return (
        values.flags.c_contiguous
        and grads.flags.c_contiguous
        and rows.flags.c_contiguous
        and rows.dtype == np.int64
        and grads.dtype == np.float32
    )


class SparseOptimizer:
    """Base of the row-wise optimizers. Subclasses set `spec` (their arguments, from
    base/optimizer_specs.py) and `state_names`. The constructor takes arguments as checked by
    `spec.arguments` (build_sparse_optimizer checks them); the ones not given take their defaults."""

    spec: ClassVar[OptimizerSpec]
    state_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **hyper: Any) -> None:
        self.hyper = {**self.spec.defaults, **hyper}

    @property
    def name(self) -> str:
        return self.spec.name

    def state_init(self) -> dict[str, float]:
        """Initial value of each state array (one row per table row, `dim` wide)."""
        return {name: 0.0 for name in self.state_names}

    def directed(self, grads: np.ndarray) -> np.ndarray:
        """The gradients to descend: negated when maximizing, as torch negates them first."""
        return np.negative(grads) if self.hyper.get("maximize") else grads

    def update(
        self, values: np.ndarray, rows: np.ndarray, grads: np.ndarray, state: dict[str, np.ndarray], step: int
    ) -> None:
        """Update `values[rows]` (distinct rows) from `grads` (len(rows) x dim)."""
        raise NotImplementedError


class SparseSGD(SparseOptimizer):
    spec = SPARSE["sgd"]

    def update(self, values, rows, grads, state, step) -> None:
        values[rows] -= np.float32(self.hyper["lr"]) * self.directed(grads)


class SparseAdagrad(SparseOptimizer):
    spec = SPARSE["adagrad"]
    state_names = ("sum",)

    def state_init(self) -> dict[str, float]:
        return {"sum": float(self.hyper["initial_accumulator_value"])}

    def update(self, values, rows, grads, state, step) -> None:
        h, grads = self.hyper, self.directed(grads)
        clr = h["lr"] / (1 + (step - 1) * h["lr_decay"])
        if kernels.KERNELS is not None and _fits(values, rows, grads):
            kernels.KERNELS.ps_sparse_adagrad(
                ptr(values), ptr(state["sum"]), ptr(rows), ptr(grads), rows.shape[0], values.shape[1], clr, h["eps"]
            )
            return
        acc = state["sum"][rows] + grads * grads
        state["sum"][rows] = acc
        values[rows] += np.float32(-clr) * (grads / (np.sqrt(acc) + np.float32(h["eps"])))


class SparseAdam(SparseOptimizer):
    spec = SPARSE["adam"]
    state_names = ("exp_avg", "exp_avg_sq")

    def update(self, values, rows, grads, state, step) -> None:
        h, grads = self.hyper, self.directed(grads)
        beta1, beta2 = h["betas"]
        if h["per_row_step"]:
            steps = state["row_step"][rows] + 1
            state["row_step"][rows] = steps
            steps = steps[:, None].astype(np.float64)
        else:
            steps = step
            if kernels.KERNELS is not None and _fits(values, rows, grads):
                kernels.KERNELS.ps_sparse_adam(
                    ptr(values),
                    ptr(state["exp_avg"]),
                    ptr(state["exp_avg_sq"]),
                    ptr(rows),
                    ptr(grads),
                    rows.shape[0],
                    values.shape[1],
                    1 - beta1,
                    1 - beta2,
                    h["lr"] * math.sqrt(1 - beta2**step) / (1 - beta1**step),
                    h["eps"],
                )
                return
        m_old, v_old = state["exp_avg"][rows], state["exp_avg_sq"][rows]
        m = (grads - m_old) * np.float32(1 - beta1) + m_old
        v = (grads * grads - v_old) * np.float32(1 - beta2) + v_old
        state["exp_avg"][rows], state["exp_avg_sq"][rows] = m, v
        step_size = (
            (h["lr"] * np.sqrt(1 - beta2**steps) / (1 - beta1**steps)).astype(np.float32)
            if h["per_row_step"]
            else np.float32(h["lr"] * math.sqrt(1 - beta2**steps) / (1 - beta1**steps))
        )
        values[rows] += -step_size * (m / (np.sqrt(v) + np.float32(h["eps"])))


class SparseFtrl(SparseOptimizer):
    spec = SPARSE["ftrl"]
    state_names = ("z", "n")

    def state_init(self) -> dict[str, float]:
        return {"z": 0.0, "n": float(self.hyper["initial_accumulator_value"])}

    def update(self, values, rows, grads, state, step) -> None:
        h = self.hyper
        alpha, beta, l1, l2 = (np.float32(h[k]) for k in ("lr", "beta", "l1", "l2"))
        w, z, n = values[rows], state["z"][rows], state["n"][rows]
        n_new = n + grads * grads
        sigma = (np.sqrt(n_new) - np.sqrt(n)) / alpha
        z = z + grads - sigma * w
        state["z"][rows], state["n"][rows] = z, n_new
        shrunk = np.sign(z) * l1 - z
        values[rows] = np.where(np.abs(z) <= l1, np.float32(0), shrunk / ((beta + np.sqrt(n_new)) / alpha + l2))


SPARSE_OPTIMIZERS: dict[str, type[SparseOptimizer]] = {
    cls.spec.name: cls for cls in (SparseSGD, SparseAdagrad, SparseAdam, SparseFtrl)
}


def build_sparse_optimizer(spec: dict) -> SparseOptimizer:
    """{"name": "sgd"|"adagrad"|"adam"|"ftrl", "hyper": {...}} -> a row-wise optimizer, its arguments
    checked (base/optimizer_specs.py); InvalidArgumentError naming what is wrong otherwise."""
    found = sparse_spec(spec)
    return SPARSE_OPTIMIZERS[found.name](**found.arguments(spec.get("hyper", {})))
