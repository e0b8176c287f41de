"""paramserver: parameter-server training for PyTorch.

Public API::

    ctx = paramserver.init()                       # join the cluster (or run one in-process)
    opt = paramserver.optim.Adam(model.parameters(), lr=1e-3)
    paramserver.Trainer(model, opt, loss_fn).fit(loader, epochs=5)
    for batch in ctx.resumable(loader): ...        # or a loop: resumes, and prefetches embedding rows
    if ctx.is_evaluator: ctx.evaluate(model, fn)    # an evaluator task: follow the run's checkpoints
    paramserver.serving.load(model, "model.safetensors")  # serve what was trained, with no cluster

Torch-dependent names load on first use, so a PS process never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# first: gRPC reads its fork setting when it loads, and base.errors imports it
from paramserver.base import grpc_fork  # noqa: F401  (isort: skip)

# before torch: libgomp reads its wait policy when it loads (base/omp_wait.py)
from paramserver.base import omp_wait  # noqa: F401  (isort: skip)
from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task
from paramserver.base.errors import (
    AlreadyExistsError,
    ConfigError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    MalformedFrameError,
    NotFoundError,
    NotInitializedError,
    ParamServerError,
    ProtocolVersionError,
    ResourceExhaustedError,
    UnavailableError,
)

__version__ = "0.1.0"

_LAZY = {
    "init": ("paramserver.api", "init"),
    "Context": ("paramserver.worker.context", "Context"),
    "current_context": ("paramserver.worker.current", "current_context"),
    "set_mode": ("paramserver.worker.current", "set_mode"),
    "log_scalar": ("paramserver.worker.current", "log_scalar"),
    "pipeline": ("paramserver.worker.current", "pipeline"),
    "Splits": ("paramserver.data.splits", "Splits"),
    "Trainer": ("paramserver.trainer", "Trainer"),
    "EpochMetrics": ("paramserver.trainer", "EpochMetrics"),
    "Callback": ("paramserver.trainer_callbacks", "Callback"),
    "EarlyStopping": ("paramserver.trainer_callbacks", "EarlyStopping"),
    "BestCheckpoint": ("paramserver.trainer_callbacks", "BestCheckpoint"),
    "evaluate": ("paramserver.evaluation.evaluator", "evaluate"),
    "Evaluation": ("paramserver.evaluation.evaluator", "Evaluation"),
    "load_export": ("paramserver.checkpoint.tools", "load_export"),
    "optim": ("paramserver.optim", None),
    "nn": ("paramserver.nn", None),
    "serving": ("paramserver.serving", None),
    "evaluation": ("paramserver.evaluation", None),
    "ray": ("paramserver.launch.ray", None),
}

__all__ = [
    "init",
    "Context",
    "current_context",
    "set_mode",
    "log_scalar",
    "pipeline",
    "Splits",
    "Trainer",
    "EpochMetrics",
    "Callback",
    "EarlyStopping",
    "BestCheckpoint",
    "evaluate",
    "Evaluation",
    "load_export",
    "optim",
    "nn",
    "serving",
    "ClusterSpec",
    "NodeConfig",
    "Options",
    "Task",
    "ParamServerError",
    "InvalidArgumentError",
    "MalformedFrameError",
    "NotFoundError",
    "FailedPreconditionError",
    "ProtocolVersionError",
    "UnavailableError",
    "DeadlineExceededError",
    "ConfigError",
    "NotInitializedError",
    "AlreadyExistsError",
    "ResourceExhaustedError",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'paramserver' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)
