"""The files of each `paramserver run` on this machine, so that `status`, `health` and `shutdown`
given no cluster find the local run, and trust it only when it is the caller's own.

The runs directory is $PARAMSERVER_RUN_DIR, else `paramserver-<uid>` in the temporary directory. It
is created with mode 0700; one that is a symbolic link, is not owned by this user or may be written
by another user is refused (ConfigError saying what to do): a run file there could be swapped.

At its start a launcher writes `run-<pid>-<tag>.secret` (the run's secret, mode 0600) and hands its
path to every node (Options.run_secret_file, read once when a node starts). Once its PS have
addresses it writes `run-<pid>-<tag>.json` (0600; written again after a roll-back, new ports):

    {"cluster": {"ps": [...], "worker": [...]}, "launcher": {"pid": P, "start_time": T}}

(with "max_workers": M for an elastic run, whose `run-<pid>-<tag>.scale` is `paramserver scale`'s
wish: launch/local/elastic.py)

(the cluster file format `node --cluster` takes) and deletes both when it stops. A run file is trusted
only if both files are regular files of this user that no one else may read or write, its launcher
(the process `pid`) is alive, is this user's, and started at `start_time` (field 22 of
/proc/<pid>/stat: a PID reused by another process does not match), and its secret is one. The secret
is what the run's nodes prove they hold before `status` or `shutdown` sends them anything that
matters (security/run_secret.py, launch/status.py).
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import secrets
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from paramserver.base.config import ClusterSpec
from paramserver.base.errors import ConfigError
from paramserver.security.run_secret import RunSecret, new_secret

log = logging.getLogger(__name__)
RUN_DIR_ENV = "PARAMSERVER_RUN_DIR"
_MAX_FILE_BYTES = 1 << 20  # a run file names a cluster's addresses: far less than this
_LISTED_REASONS = 3  # how many untrusted run files an error names


def runs_dir() -> Path:
    return Path(os.environ.get(RUN_DIR_ENV) or Path(tempfile.gettempdir()) / f"paramserver-{os.getuid()}")


def check_runs_dir(folder: Path, uid: int | None = None) -> None:
    """Refuse `folder` (ConfigError saying what to do) unless it is a directory, not a symbolic link,
    owned by `uid` (default: this process's user) and writable by no one else."""
    uid = os.getuid() if uid is None else uid
    info = os.lstat(folder)
    why = None
    if stat.S_ISLNK(info.st_mode):
        why = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        why = "is not a directory"
    elif info.st_uid != uid:
        why = f"is owned by uid {info.st_uid}, not by you (uid {uid})"
    elif info.st_mode & 0o022:
        who = "anyone" if info.st_mode & 0o002 else "its group"
        why = f"may be written by {who} (mode {stat.S_IMODE(info.st_mode):04o})"
    if why is not None:
        raise ConfigError(
            f"runs directory {folder} {why}: a run file there could be swapped by another user. Remove it "
            f"(or chmod 0700 it, if it is yours), or set {RUN_DIR_ENV} to a directory of your own "
            f"(paramserver creates it with mode 0700)"
        )


def ensure_runs_dir() -> Path:
    """The runs directory, created (mode 0700) if missing, and checked (check_runs_dir)."""
    folder = runs_dir()
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    check_runs_dir(folder)
    return folder


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc/<pid>/stat field 22), or None if
    there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields after it follow the last ")"
    fields = text.rpartition(")")[2].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def started_at(pid: int) -> float | None:
    """When process `pid` started, as Unix time (boot time plus its start_time), or None."""
    ticks = start_time(pid)
    if ticks is None:
        return None
    try:
        lines = Path("/proc/stat").read_text().splitlines()
        boot = next(int(line.split()[1]) for line in lines if line.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def command_line(pid: int) -> str:
    """Process `pid`'s command line, its arguments joined by spaces ("" if there is no such process)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)


def user_name(uid: int | None) -> str:
    """The login name of `uid` (its number where it has none; "?" for None)."""
    if uid is None:
        return "?"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def owner(pid: int) -> int | None:
    """The user id process `pid` runs as, or None if there is no such process."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


class LauncherFiles:
    """A launcher's own secret and run file, in the runs directory. `create()` writes the secret."""

    def __init__(self, folder: Path) -> None:
        self.pid = os.getpid()
        self.start_time = start_time(self.pid)
        stem = f"run-{self.pid}-{secrets.token_hex(4)}"
        self.secret_path = folder / f"{stem}.secret"
        self.run_path = folder / f"{stem}.json"

    @classmethod
    def create(cls) -> LauncherFiles:
        """The runs directory checked (ConfigError saying what to do), files of launchers gone
        deleted, and a new secret written for this launcher."""
        folder = ensure_runs_dir()
        sweep_dead(folder)
        files = cls(folder)
        _write_private(files.secret_path, new_secret() + "\n")
        return files

    def write(self, cluster: dict[str, list[str]], max_workers: int = 0) -> Path:
        """Write (or replace) this launcher's run file; returns its path. `max_workers` > 0: an elastic
        run, which `paramserver scale` may resize (launch/local/elastic.py)."""
        record: dict = {"cluster": cluster, "launcher": {"pid": self.pid, "start_time": self.start_time}}
        if max_workers:
            record["max_workers"] = max_workers
        partial = self.run_path.with_suffix(".tmp")
        partial.unlink(missing_ok=True)
        _write_private(partial, json.dumps(record))
        partial.replace(self.run_path)  # a reader never sees half a file
        return self.run_path

    def remove(self) -> None:
        for path in (self.run_path, self.run_path.with_suffix(".tmp"), self.secret_path, *self._wishes()):
            path.unlink(missing_ok=True)

    def _wishes(self) -> tuple[Path, ...]:
        return self.run_path.with_suffix(".scale"), self.run_path.with_suffix(".scale-tmp")


@dataclass(frozen=True)
class LocalRun:
    """A run file this user may trust: its cluster, and the secret its nodes prove they hold."""

    path: Path
    cluster: ClusterSpec
    pid: int
    secret: RunSecret
    max_workers: int = 0  # an elastic run's slots (`paramserver scale`); 0: a fixed worker set

    @property
    def name(self) -> str:
        """`run-<pid>-<tag>`: what `paramserver status RUN` takes."""
        return self.path.stem

    @property
    def owner(self) -> str:
        """The user the launcher runs as (read_run checked it is the caller)."""
        return user_name(owner(self.pid))

    @property
    def started_at(self) -> float | None:
        """When the launcher started (Unix time), or None if it is gone."""
        return started_at(self.pid)

    @property
    def command(self) -> str:
        """The launcher's command line ("" if it is gone)."""
        return command_line(self.pid)


def read_run(path: Path, uid: int | None = None) -> LocalRun:
    """The run of run file `path`, if it is to be trusted (module docstring); else ConfigError naming why."""
    uid = os.getuid() if uid is None else uid
    text = _read_private(path, uid)
    try:
        record = json.loads(text)
        launcher = record["launcher"]
        pid, started = launcher["pid"], launcher["start_time"]
        if not (type(pid) is int and type(started) is int and path.name.startswith(f"run-{pid}-")):
            raise ValueError("its launcher's pid and start time do not match its name")
        cluster = ClusterSpec.from_dict(record["cluster"])
        max_workers = record.get("max_workers", 0)
        if type(max_workers) is not int or max_workers < 0:
            raise ValueError(f"max_workers must be a non-negative integer, got {max_workers!r}")
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is not a run file: {exc}") from None
    if start_time(pid) != started or owner(pid) != uid:
        raise ConfigError(
            f"{path}: its launcher (pid {pid}) is not running (not as you, or not since the file's start)"
        )
    secret_path = path.with_suffix(".secret")
    try:
        secret = RunSecret(_read_private(secret_path, uid).strip())
    except ConfigError as exc:
        raise ConfigError(f"{path}: its secret: {exc}") from None
    return LocalRun(path, cluster, pid, secret, max_workers)


def local_runs(uid: int | None = None) -> tuple[list[LocalRun], list[str]]:
    """Every run of this user on this machine that its files show to be trusted (read_run), oldest
    launcher first, and why each other run file there is not. Raises ConfigError when the runs
    directory is refused (check_runs_dir). Runs of other users are never read: their runs directories
    are theirs, and one shared through $PARAMSERVER_RUN_DIR is refused."""
    folder = runs_dir()
    if not os.path.lexists(folder):
        return [], []
    check_runs_dir(folder, uid)
    runs, refused = [], []
    for path in sorted(folder.glob("run-*.json")):
        try:
            runs.append(read_run(path, uid))
        except (ConfigError, OSError) as exc:
            refused.append(str(exc))
    runs.sort(key=lambda run: (run.started_at or 0.0, run.name))
    return runs, refused


def local_run(uid: int | None = None, choice: str | None = None) -> LocalRun:
    """The run of this user on this machine that its files show to be trusted (read_run): the one
    `choice` names (its name `run-<pid>-<tag>`, its launcher's pid, or its run file's path), else
    the only one. Raises ConfigError when the runs directory is refused (check_runs_dir), or there
    is no such run (naming why the run files there are not trusted), or several (naming them)."""
    runs, refused = local_runs(uid)
    none = "no cluster given: name a cluster file, set TF_CONFIG, or start `paramserver run` on this machine"
    if choice is not None:
        return _chosen(runs, refused, choice)
    if not runs:
        raise ConfigError(f"{none} ({len(refused)} run file(s) not trusted: {_listed(refused)})" if refused else none)
    if len(runs) > 1:
        named = ", ".join(str(run.path) for run in runs)
        raise ConfigError(f"{len(runs)} runs of yours on this machine: name one by its run file: {named}")
    return runs[0]


def _chosen(runs: list[LocalRun], refused: list[str], choice: str) -> LocalRun:
    matches = [run for run in runs if choice in (run.name, str(run.pid), str(run.path), run.path.name)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ConfigError(f"{choice!r} names {len(matches)} runs: name one ({', '.join(r.name for r in matches)})")
    yours = ", ".join(run.name for run in runs) or "none"
    why = f"; {len(refused)} run file(s) not trusted: {_listed(refused)}" if refused else ""
    raise ConfigError(f"no run {choice!r} of yours on this machine (your runs: {yours}{why})")


def _listed(refused: list[str]) -> str:
    return "; ".join(refused[:_LISTED_REASONS]) + ("; ..." if len(refused) > _LISTED_REASONS else "")


def is_run_name(text: str) -> bool:
    """Whether `text` has the form of a run's name (`run-<pid>-<tag>`) or of a launcher's pid."""
    return re.fullmatch(r"run-\d+-[0-9a-f]+|\d+", text) is not None


def sweep_dead(folder: Path) -> None:
    """Delete the files launchers left when they were killed (a run file whose launcher is gone, a
    secret without a live launcher): in a directory check_runs_dir accepted, they are this user's."""
    leftovers = ("run-*.json", "run-*.secret", "run-*.tmp", "run-*.scale", "run-*.scale-tmp")
    for path in [found for pattern in leftovers for found in folder.glob(pattern)]:
        pid = path.name.split("-")[1]
        if not pid.isdigit() or owner(int(pid)) is not None:
            continue  # alive (or a PID taken again since: kept, and not trusted by read_run)
        path.unlink(missing_ok=True)
        log.debug("deleted %s: its launcher is gone", path)


def _write_private(path: Path, text: str) -> None:
    """Create `path` (never through a link, never over a file) readable and writable by this user only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def _read_private(path: Path, uid: int) -> str:
    """The text of `path`, a regular file (not a link) of user `uid` that no one else may read or write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"cannot open {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{path} is not a regular file")
        if info.st_uid != uid:
            raise ConfigError(f"{path} is owned by uid {info.st_uid}, not by you (uid {uid})")
        if info.st_mode & 0o077:
            raise ConfigError(f"{path} may be read or written by others (mode {stat.S_IMODE(info.st_mode):04o})")
        data = file.read(_MAX_FILE_BYTES + 1)
    if len(data) > _MAX_FILE_BYTES:
        raise ConfigError(f"{path} is larger than a run file ({_MAX_FILE_BYTES} bytes)")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not text: {exc}") from None
