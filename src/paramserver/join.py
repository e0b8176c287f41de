"""`paramserver.init()`'s worker side: join the cluster this process belongs to.

Where the configuration comes from, in order: the argument; the config of the `paramserver node`
command running this script; TF_CONFIG in the environment; and, when there is none, an in-process
cluster (shards in this process, no network) so that a plain `python script.py` runs and can be
stepped through in a debugger.
"""

from __future__ import annotations

import os

from paramserver.base import config as config_mod
from paramserver.base.config import NodeConfig
from paramserver.evaluation.evaluator import EvaluatorContext
from paramserver.launch import threads
from paramserver.worker import current
from paramserver.worker.cluster import cluster_context, in_process_context
from paramserver.worker.context import Context


def join(config: NodeConfig | None, num_ps: int = 1) -> Context:
    """This worker's Context: the one already made, else a new one joining the cluster of
    `config` (a worker task), or an in-process cluster of `num_ps` shards without one; an
    evaluator task's follows checkpoints and joins nothing. Called by `paramserver.init()`,
    which sends PS tasks to their node instead."""
    existing = current.existing()
    if existing is not None:
        return existing
    if config is not None and config.task.type == config_mod.EVALUATOR:
        return current.adopt(EvaluatorContext(config, config.options))
    if config is None:  # a run's single worker, threads chosen as `paramserver run` chooses (launch/threads.py)
        return current.adopt(in_process_context(num_ps, threads.lone_worker_threads(os.environ)))
    return current.adopt(cluster_context(config))
