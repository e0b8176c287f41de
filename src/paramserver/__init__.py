"""paramserver: parameter-server training for PyTorch.

Public API::

    ctx = paramserver.init()                       # join the cluster (or run one in-process)
    opt = paramserver.optim.Adam(model.parameters(), lr=1e-3)
    paramserver.Trainer(model, opt, loss_fn).fit(loader, epochs=5)

Torch-dependent names load on first use, so a PS process never imports torch.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

# Set before anything imports grpc (errors.py does, just below): gRPC reads it when it is loaded.
# With gRPC's fork handlers on (grpcio's default), every fork() of a worker -- a torch DataLoader
# starting its worker processes, each epoch -- restarts gRPC's threads inside the child, on state
# copied from the parent's threads that were busy in gRPC (heartbeats, channels, the coordinator's
# server): the child segfaults or hangs. Off, a forked child leaves gRPC alone (it never calls it).
# A value the user set wins. Children of `paramserver run` inherit it. See docs/configuration.md.
GRPC_FORK_SUPPORT_ENV = "GRPC_ENABLE_FORK_SUPPORT"
# grpc was loaded before paramserver with the variable unset: its fork handlers stay on in this process
_grpc_fork_handlers_on = "grpc" in sys.modules and not os.environ.get(GRPC_FORK_SUPPORT_ENV)
if not os.environ.get(GRPC_FORK_SUPPORT_ENV):
    os.environ[GRPC_FORK_SUPPORT_ENV] = "0"

from .config import ClusterSpec, NodeConfig, Options, Task
from .errors import (ConfigError, DeadlineExceededError, FailedPreconditionError, InvalidArgumentError,
                     MalformedFrameError, NotFoundError, NotInitializedError, ParamServerError,
                     ProtocolVersionError, UnavailableError)

__version__ = "0.1.0"

_LAZY = {
    "init": ("paramserver.worker.context", "init"),
    "Context": ("paramserver.worker.context", "Context"),
    "current_context": ("paramserver.worker.context", "current_context"),
    "set_mode": ("paramserver.worker.context", "set_mode"),
    "Trainer": ("paramserver.worker.trainer", "Trainer"),
    "EpochMetrics": ("paramserver.worker.trainer", "EpochMetrics"),
    "optim": ("paramserver.optim", None),
    "nn": ("paramserver.nn", None),
}

__all__ = ["init", "Context", "current_context", "set_mode", "Trainer", "EpochMetrics", "optim", "nn", "ClusterSpec",
           "NodeConfig", "Options", "Task", "ParamServerError", "InvalidArgumentError", "MalformedFrameError",
           "NotFoundError", "FailedPreconditionError", "ProtocolVersionError", "UnavailableError",
           "DeadlineExceededError", "ConfigError", "NotInitializedError"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'paramserver' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    return module if attr is None else getattr(module, attr)
