"""`paramserver.init()`: the one call at the top of a training script, the same on every node."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from paramserver.base.config import NodeConfig
from paramserver.base.errors import ConfigError
from paramserver.worker import current

if TYPE_CHECKING:
    from types import FrameType

    from paramserver.worker.context import Context


def init(config: NodeConfig | None = None, *, num_ps: int = 1) -> Context:
    """Join the cluster and return this worker's Context (see paramserver.join for
    where the cluster's description comes from).

    On a PS task this serves the shard until the node is stopped and then exits the process,
    so one script can be started unchanged on every node. `num_ps` sets the number of shards
    of the in-process cluster only. Calling it again returns the same Context.
    """
    existing = current.existing()
    if existing is not None:
        return existing
    config = config or current.node_config()
    if config is not None and _in_spawned_reimport():
        raise ConfigError(
            "paramserver.init() ran while a process started with 'spawn' (e.g. a DataLoader "
            "worker) imported your script again; it would join the cluster a second time. Put "
            'the training under `if __name__ == "__main__":`, as torch documents for spawn'
        )
    if config is not None and config.task.type == "ps":
        from paramserver.node.ps_process import run_ps_node  # here: a worker never loads the PS node

        raise SystemExit(run_ps_node(config.listed_address(), config.task.index, config.options))
    from paramserver.join import join  # here: a PS task never loads torch

    return join(config, num_ps)


def _in_spawned_reimport() -> bool:
    """Whether this call comes from the module-level code of `__mp_main__`: multiprocessing's
    'spawn' (or 'forkserver') running the main script again in a child process."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return True
        frame = frame.f_back
    return False
