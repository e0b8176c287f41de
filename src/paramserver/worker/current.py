"""The process's one Context, and the module-level functions that act on it.

Set by join.py (`paramserver.init()`), cleared when the Context shuts down. `paramserver
node` names the config a script's `init()` uses before it runs the script. Not thread-safe: called
from the training script's main thread.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from paramserver.base import config as config_mod
from paramserver.base.config import NodeConfig
from paramserver.base.consistency_spec import ConsistencySpec
from paramserver.base.errors import NotInitializedError

if TYPE_CHECKING:
    from paramserver.worker.context import Context

_current: Any = None  # the Context (or EvaluatorContext) of this process
_launched: NodeConfig | None = None  # set by `paramserver node` before it runs the script


def set_launched_config(config: NodeConfig | None) -> None:
    """Called by `paramserver node` so that `init()` in the script uses the node's config."""
    global _launched
    _launched = config


def node_config() -> NodeConfig | None:
    """The config this process runs under: given by `paramserver node`, else TF_CONFIG, else None."""
    return _launched or config_mod.config_from_environ(os.environ)


def existing() -> Context | None:
    """This process's Context, or None before `paramserver.init()`."""
    return _current


def adopt(context: Any) -> Any:
    """Make `context` this process's Context; returns it."""
    global _current
    _current = context
    return context


def forget(context: Any) -> None:
    """`context` shut down: it is no longer this process's Context (another one is left alone)."""
    global _current
    if _current is context:
        _current = None


def current_context() -> Context:
    if _current is None:
        raise NotInitializedError("call paramserver.init() before creating a paramserver optimizer")
    return _current


def set_mode(mode: str, backup_workers: int | None = None) -> ConsistencySpec:
    """Switch the cluster's consistency mode while training runs; see Context.set_mode (chief only)."""
    return current_context().set_mode(mode, backup_workers)


def pipeline(batches):
    """`batches`, each step bringing back the embedding rows of the batch after it; see Context.pipeline."""
    return current_context().pipeline(batches)


def log_scalar(name: str, value: float, step: int | None = None) -> None:
    """Write a scalar to TensorBoard (chief only, with a logdir); see Context.log_scalar."""
    current_context().log_scalar(name, value, step)
