"""`paramserver status [CLUSTER | RUN] [--run RUN]`: which cluster to show, and the list of this
user's runs on this machine when several could be meant (docs/operations.md).

A run is named by its name (`run-<pid>-<tag>`, the stem of its run file), its launcher's pid, or its
run file's path; only the caller's own runs are listed or chosen (launch/local/run_files.py), each
with its owner, its launcher's start time and command line, so that two runs are told apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from paramserver.base.config import Options, config_from_environ, load_cluster_file
from paramserver.launch.cli import commands
from paramserver.launch.local.run_files import LocalRun, is_run_name, local_run, local_runs, runs_dir

_RUN_COLUMNS = ("RUN", "PID", "OWNER", "STARTED", "PS", "WORKERS", "COMMAND")
_COMMAND_WIDTH = 60  # a launcher's command line is cut to this in the table (`--json` has it whole)


def status(args: argparse.Namespace) -> int:
    """Print the chosen cluster's status (launch/status.py); with several runs of this user and none
    chosen, print them (RUN, PID, OWNER, STARTED, ...) and exit 2, saying how to choose."""
    from paramserver.launch.status import run_status

    access = commands.status_access(args)
    choice = args.run or _run_named(args.cluster)
    if choice is None and args.cluster:
        return run_status(
            load_cluster_file(args.cluster, "ps", 0).cluster, args.json, args.interval, args.timeout, access
        )
    if choice is None:
        config = config_from_environ(os.environ, Options())
        if config is not None:
            return run_status(config.cluster, args.json, args.interval, args.timeout, access)
        runs, _ = local_runs()
        if len(runs) > 1:
            print(json.dumps([describe(run) for run in runs]) if args.json else runs_table(runs), flush=True)
            print(
                f"paramserver: {len(runs)} runs of yours on this machine: choose one with "
                f"`paramserver status RUN` (RUN: its name or pid)",
                file=sys.stderr,
            )
            return 2
    run = local_run(choice=choice)
    return run_status(run.cluster, args.json, args.interval, args.timeout, access, run.secret)


def _run_named(cluster: str | None) -> str | None:
    """The run CLUSTER names, if it names one of the runs directory rather than a cluster file: a
    run's name or pid that is no file here, or a run file there (whose nodes must then prove they
    belong to the run, as when it is found)."""
    if not cluster:
        return None
    path = Path(cluster)
    if not path.exists():
        return cluster if is_run_name(cluster) else None
    if path.name.startswith("run-") and path.suffix == ".json" and path.resolve().parent == runs_dir().resolve():
        return str(runs_dir() / path.name)
    return None


def describe(run: LocalRun) -> dict:
    """One run as `status --json` lists it."""
    started = run.started_at
    return {
        "run": run.name,
        "pid": run.pid,
        "owner": run.owner,
        "started": _iso(started) if started is not None else None,
        "ps": len(run.cluster.ps),
        "workers": len(run.cluster.chief) + len(run.cluster.worker),
        "command": run.command,
        "file": str(run.path),
    }


def runs_table(runs: list[LocalRun]) -> str:
    """The runs as aligned text columns, with a header line."""
    rows = [list(_RUN_COLUMNS)]
    for run in runs:
        described = describe(run)
        command = described["command"]
        if len(command) > _COMMAND_WIDTH:
            command = command[: _COMMAND_WIDTH - 3] + "..."
        keys = ("run", "pid", "owner", "started", "ps", "workers")
        rows.append([*("-" if described[key] is None else str(described[key]) for key in keys), command or "-"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(_RUN_COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def _iso(unix_time: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix_time))
