"""`main`: the console entry point of `paramserver`: parse, set up logging and signals, run the command."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from paramserver.base.config import options_from_environ
from paramserver.base.errors import ConfigError, ParamServerError
from paramserver.launch.cli import commands
from paramserver.launch.cli.option_flags import given_options
from paramserver.launch.cli.parser import parse_args
from paramserver.launch.logs import configure_logging


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _configure_logging(args)
    # SIGTERM stops a launcher as cleanly as Ctrl-C does; SIGINT is set too, since a process started in
    # the background by a shell (or by a job that was) inherits SIGINT ignored, and `kill -INT` must still stop it.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        return _run_command(args)
    except ParamServerError as exc:
        print(f"paramserver: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _run_command(args: argparse.Namespace) -> int:
    if args.command == "run":
        return commands.run_local(args, args.script, commands.strip_dashes(args.args))
    if args.command == "demo":
        return commands.run_local(args, str(commands.demo_script()), ["--epochs", str(args.epochs)])
    if args.command == "certs":
        return commands.make_certs(args)
    if args.command == "k8s":
        return commands.k8s(args)
    if args.command == "slurm":
        return commands.slurm(args)
    if args.command == "health":
        return commands.health(args)
    if args.command == "checkpoint":
        if args.since is not None:
            from paramserver.checkpoint.export.delta_export import run_delta_export

            return run_delta_export(args.action, args.dir, args.name, args.out, args.since)
        from paramserver.checkpoint.tools import run_tool

        return run_tool(args.action, args.dir, args.name, args.out)
    if args.command == "status":
        from paramserver.launch.cli.status_command import status

        return status(args)
    if args.command == "scale":
        return commands.scale(args.target)
    if args.command == "shutdown":
        from paramserver.launch.status import shutdown_cluster

        cluster, secret = commands.target(args.cluster)
        return shutdown_cluster(cluster, args.timeout, commands.status_access(args), args.reason, secret)
    from paramserver.launch.node_command import run_node

    script_args = commands.strip_dashes(args.args)
    return run_node(args.cluster, args.role, args.index, args.bind, args.script, script_args, given_options(args))


def _configure_logging(args: argparse.Namespace) -> None:
    """Text or JSON lines: --log-format, else (a node the launcher started) PARAMSERVER_OPTIONS'
    log_format. A node names itself once its role is known (node.run_node)."""
    log_format = getattr(args, "log_format", None)
    if log_format is None and args.command == "node":
        try:
            log_format = options_from_environ(os.environ).log_format
        except ConfigError:  # run_node reports it, naming the bad option
            pass
    node = "launcher" if args.command in ("run", "demo") else ""
    configure_logging(args.log_level, log_format or "text", node=node, role=node)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
