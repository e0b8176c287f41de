"""`paramserver node`: run one node of a multi-host cluster.

The node's role comes from `--cluster FILE --role R --index I`, from TF_CONFIG, or, in a task
started by `srun` with neither, from the Slurm job step's environment (launch/slurm). A PS
node serves its shard until SIGTERM; a worker (or chief) node runs SCRIPT with ARGS as
`__main__`, and `paramserver.init()` inside it joins the cluster this node belongs to. An
evaluator node runs the same SCRIPT, whose `init()` joins nothing (evaluation/evaluator.py), and
exits 0 whatever happens to it.

Under a restart loop (Kubernetes' restartPolicy, a supervisor), recovery needs no launcher:
- a PS of a cluster with a checkpoint_dir starts from the latest complete checkpoint there;
- a PS or the chief that restarted makes the cluster roll back to that checkpoint: the chief
  restarts (or, restarted, finds the PS holding state), asks every PS to restart,
  and every worker that learns of it exits with RESTART_EXIT_CODE to be started again
  (docs/recovery.md, "When a pod dies").
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import runpy
import sys
from pathlib import Path

from paramserver.base import config as config_mod
from paramserver.base.config import NodeConfig, Options, bind_address
from paramserver.base.errors import ConfigError, RollbackError
from paramserver.base.lifecycle import RESTART_EXIT_CODE
from paramserver.launch import threads
from paramserver.launch.logs import name_node, node_name
from paramserver.launch.slurm.environment import in_slurm_step, slurm_config

log = logging.getLogger(__name__)
# RESTART_EXIT_CODE (75, EX_TEMPFAIL; base/lifecycle.py): a node asks its restart loop to start it again (a
# roll-back). Kubernetes restarts it under restartPolicy OnFailure; a TFJob's ExitCode policy retries only 128 and up.


def resolve(cluster_file: str | None, role: str | None, index: int | None, options: Options) -> NodeConfig | None:
    """The node's config from flags (a cluster file), TF_CONFIG, or both; else, in a Slurm job step
    (srun) given no --role, from the step's environment; None if none of them is given.

    With `--cluster FILE` and no `--role`, the task is TF_CONFIG's and the file gives the whole
    cluster (what a TFJob's sparse TF_CONFIG leaves out)."""
    if cluster_file and role is None and os.environ.get(config_mod.TF_CONFIG_ENV):
        whole, options = config_mod.read_cluster_file(cluster_file, options)
        return config_mod.config_from_environ(os.environ, options, whole)
    if cluster_file:
        if role is None:
            raise ConfigError("--cluster needs --role (ps, worker, chief or evaluator), or TF_CONFIG naming the task")
        return config_mod.load_cluster_file(cluster_file, role, index or 0, options)
    config = config_mod.config_from_environ(os.environ, options)
    if config is None and role is None and not os.environ.get(config_mod.CLUSTER_ENV) and in_slurm_step(os.environ):
        return slurm_config(os.environ, options)  # a --role (e.g. a PS `paramserver run` starts) keeps its flags
    if config is None and role is not None and os.environ.get(config_mod.CLUSTER_ENV):
        whole = config_mod.cluster_from_text(os.environ[config_mod.CLUSTER_ENV], config_mod.CLUSTER_ENV)
        return NodeConfig(whole, config_mod.Task(role, index or 0), options)
    if config is not None and role is not None and (role, index or 0) != (config.task.type, config.task.index):
        raise ConfigError(
            f"--role {role} --index {index or 0} contradicts TF_CONFIG's task {config.task.type}:{config.task.index}"
        )
    return config


def whole_lines() -> None:
    """Make each line of this node's stdout and stderr one write, yet shown at once.

    Launchers merge a node's stdout and stderr into one pipe. Unbuffered streams (PYTHONUNBUFFERED)
    write print's text and its newline apart, and a log line of another thread can land between them.
    """
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def run_node(
    cluster_file: str | None,
    role: str | None,
    index: int | None,
    bind: str | None,
    script: str | None,
    args: list[str],
    overrides: dict | None = None,
) -> int:
    """Run this node to completion; returns the process exit code. `overrides` are options given as flags."""
    # before torch (and its OpenMP) loads: idle OpenMP threads sleep unless the environment chose otherwise
    os.environ.update(threads.wait_policy_env(os.environ))
    whole_lines()
    options = config_mod.options_from_environ(os.environ)
    if overrides:
        options = config_mod.Options.from_dict({**dataclasses.asdict(options), **overrides})
    config = resolve(cluster_file, role, index, options)
    role = config.task.type if config else role
    name_node(node_name(role or "node", config.task.index if config else index or 0), role or "")
    if role == "ps":
        from paramserver.node.ps_process import run_ps_node

        if bind is None and config is None:
            raise ConfigError("a PS node needs TF_CONFIG, --cluster, or --bind HOST:PORT")
        if config is not None:  # with the cluster file's own options
            options = config.options
        if config is not None and options.checkpoint_dir:  # a restarted PS of a cluster resumes by itself
            options = dataclasses.replace(options, resume=True)
        if not bind:
            if config is None:  # only with an empty --bind: None without a config was refused above
                raise ConfigError("a PS node needs TF_CONFIG, --cluster, or --bind HOST:PORT")
            bind = bind_address(config.listed_address())
        listed = config.listed_address() if config is not None else None
        return run_ps_node(bind, config.task.index if config else index or 0, options, cluster_address=listed)
    if config is None and bind and role is None:
        raise ConfigError("--bind is where a PS listens: give --role ps too")
    if config is None:
        raise ConfigError(
            "a worker node needs TF_CONFIG, --cluster FILE --role worker --index I, or a Slurm job step (srun)"
        )
    if role == config_mod.EVALUATOR:
        return run_evaluator(config, script, args)
    if not script:
        raise ConfigError(f"a {role} node needs the training SCRIPT to run")
    return run_script(config, script, args)


def run_evaluator(config: NodeConfig, script: str | None, args: list[str]) -> int:
    """Run the script on an evaluator task; always exit 0, logging what failed: a TFJob marks the
    whole job failed when any replica fails, and an evaluator is no part of the training."""
    try:
        if not script:
            raise ConfigError("an evaluator node needs the SCRIPT to run (the same as the workers')")
        code = run_script(config, script, args)
    except KeyboardInterrupt:  # SIGTERM too (cli.main): the job is ending
        log.info("evaluator %d: stopped", config.task.index)
        return 0
    except BaseException as exc:
        log.exception("evaluator %d failed; exiting with 0 (an evaluator never fails the job)", config.task.index)
        _report_evaluator_failure(config, f"{type(exc).__name__}: {exc}")
        return 0
    if code != 0:
        log.error(
            "evaluator %d: the script exited with %s; exiting with 0 (an evaluator never fails the job)",
            config.task.index,
            code,
        )
        _report_evaluator_failure(config, f"the script exited with {code}")
    return 0


def _report_evaluator_failure(config: NodeConfig, why: str) -> None:
    """Tell `paramserver run` (its progress pipe, when it gave one) that the evaluator failed, for its closing line."""
    if config.options.progress_fd < 0:
        return
    from paramserver.worker.progress import ProgressWriter

    writer = ProgressWriter(config.options.progress_fd, worker=-1)
    writer.result({"evaluator_error": why})
    writer.close(done=False)


def run_script(config: NodeConfig, script: str, args: list[str]) -> int:
    """Run the user's script as __main__ in this process, with `init()` bound to `config`."""
    from paramserver.worker import current
    from paramserver.worker.recovery import preemption  # here: a PS node never loads the worker side (torch)

    path = Path(script)
    if not path.is_file():
        raise ConfigError(f"training script {script} does not exist")
    current.set_launched_config(config)
    sys.argv = [str(path), *args]
    sys.path.insert(0, str(path.resolve().parent))
    log.info("%s %d: running %s", config.task.type, config.task.index, path)
    leaves_alone = config.options.max_workers > 0 and config.worker_index != 0  # an elastic run's worker
    if (config.options.checkpoint_dir or leaves_alone) and config.task.type != config_mod.EVALUATOR:
        preemption.install(config.options.preempt_grace_s, leaves_alone)  # SIGTERM: a checkpoint (or a leave)
    completed = False
    try:
        runpy.run_path(str(path), run_name="__main__")
        completed = True
    except preemption.Preempted as stopped:
        log.info("%s %d: %s", config.task.type, config.task.index, stopped)
        return stopped.exit_code
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        completed = code == 0
        return code
    except Exception as exc:
        context = current.existing()
        why = context.rollback_reason() if context is not None else None
        if why is None and isinstance(exc, RollbackError):  # e.g. while it joined: no context yet
            why = str(exc)
        if why is None:
            raise
        log.warning(
            "%s %d: the cluster rolls back (%s); exiting with %d to be restarted (the script stopped with %s: %s)",
            config.task.type,
            config.task.index,
            why,
            RESTART_EXIT_CODE,
            type(exc).__name__,
            exc,
            extra={"event": "rollback_exit"},
        )
        return RESTART_EXIT_CODE
    finally:
        context = current.existing()
        if context is not None:
            context.shutdown(completed)
    return 0
