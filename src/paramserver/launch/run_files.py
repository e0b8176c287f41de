"""The cluster file of each `paramserver run` on this machine, so that `status`, `health` and
`shutdown` given no cluster find the local run.

A run writes `run-<launcher pid>.json` ({"cluster": {"ps": [...], "worker": [...]}}, the format
`node --cluster` takes) into the runs directory once its nodes have addresses, writes it again
after a roll-back (new ports), and deletes it when it stops. The directory is
$PARAMSERVER_RUN_DIR, else `paramserver-<uid>` in the temporary directory (mode 0700: the files
are this user's).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import psutil

from ..base.errors import ConfigError

RUN_DIR_ENV = "PARAMSERVER_RUN_DIR"


def runs_dir() -> Path:
    return Path(os.environ.get(RUN_DIR_ENV) or Path(tempfile.gettempdir()) / f"paramserver-{os.getuid()}")


def write_run_file(cluster: dict[str, list[str]]) -> Path:
    """Write (or replace) this launcher's cluster file; returns its path."""
    folder = runs_dir()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = folder / f"run-{os.getpid()}.json"
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps({"cluster": cluster}))
    partial.replace(path)  # a reader never sees half a file
    return path


def remove_run_file(path: Path) -> None:
    path.unlink(missing_ok=True)


def local_run() -> Path:
    """The cluster file of the one `paramserver run` running on this machine (as this user).
    Files of launchers that died (SIGKILL leaves them) are skipped. Raises ConfigError when there
    is none, or several (naming them)."""
    live = [path for path in sorted(runs_dir().glob("run-*.json")) if _launcher_alive(path)]
    if not live:
        raise ConfigError(
            "no cluster given: name a cluster file, set TF_CONFIG, or start `paramserver run` on this machine"
        )
    if len(live) > 1:
        raise ConfigError(
            f"{len(live)} runs on this machine: name one of their cluster files: {', '.join(map(str, live))}"
        )
    return live[0]


def _launcher_alive(path: Path) -> bool:
    try:
        return psutil.pid_exists(int(path.stem.removeprefix("run-")))
    except ValueError:
        return False
