"""Typed configuration of a node: the cluster, this node's task, and runtime options.

Read once when a node starts, from one of:
- ``TF_CONFIG`` (TensorFlow / Kubeflow TFJob JSON: {"cluster": {...}, "task": {"type", "index"}}),
- a cluster file plus ``--role`` / ``--index`` flags,
and ``PARAMSERVER_OPTIONS`` (JSON of :class:`Options`, set by ``paramserver run``).
Nothing below this module reads the environment.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

ROLES = ("chief", "worker", "ps")
OPTIONS_ENV = "PARAMSERVER_OPTIONS"
TF_CONFIG_ENV = "TF_CONFIG"


@dataclass(frozen=True)
class ClusterSpec:
    """Addresses ("host:port") of every node, by role. A chief, if present, is worker number 0."""

    ps: tuple[str, ...] = ()
    worker: tuple[str, ...] = ()
    chief: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> "ClusterSpec":
        if not isinstance(spec, Mapping):
            raise ConfigError(f"cluster spec must be an object of role -> address list, got {spec!r}")
        unknown = sorted(set(spec) - set(ROLES) - {"evaluator", "options"})
        if unknown:
            raise ConfigError(f"cluster spec has unknown roles {unknown}; known: {list(ROLES)}")
        lists = {}
        for role in ROLES:
            addresses = spec.get(role, [])
            if not isinstance(addresses, list) or not all(isinstance(a, str) and ":" in a for a in addresses):
                raise ConfigError(f"cluster role {role!r} must be a list of 'host:port' strings, got {addresses!r}")
            lists[role] = tuple(addresses)
        if len(lists["chief"]) > 1:
            raise ConfigError(f"a cluster has at most one chief, got {len(lists['chief'])}")
        if not lists["ps"]:
            raise ConfigError("cluster spec needs at least one 'ps' address")
        if not lists["worker"] and not lists["chief"]:
            raise ConfigError("cluster spec needs at least one 'worker' (or 'chief') address")
        return cls(**lists)

    def to_dict(self) -> dict[str, list[str]]:
        return {role: list(getattr(self, role)) for role in ROLES if getattr(self, role)}

    @property
    def num_workers(self) -> int:
        return len(self.chief) + len(self.worker)


@dataclass(frozen=True)
class Task:
    """This node's role and index within that role."""

    type: str
    index: int


@dataclass(frozen=True)
class Options:
    """Runtime options shared by every role. See docs/configuration.md."""

    rpc_timeout_s: float = 60.0  # deadline of every call to a PS
    connect_timeout_s: float = 120.0  # how long a worker waits for all PS at start
    max_message_bytes: int = 1 << 30  # largest gRPC message sent or received
    split_bytes: int = 256 * 1024  # variables this large are split along axis 0 across PS
    ps_threads: int = 8  # gRPC request threads of a PS
    stream_port: int = 0  # TCP port of a PS's tensor stream; 0 picks a free one (announced in Hello)
    use_stream: int = 1  # 1: pushes and pulls travel on the tensor stream; 0: on gRPC
    shared_memory: int = 1  # 1: a worker on the PS's host passes tensors through shared memory
    torch_threads: int = 0  # intra-op threads of a worker's torch; 0 keeps torch's default
    progress_fd: int = -1  # file descriptor a worker writes progress lines to; -1: none
    mode: str = "async"  # consistency: async, sync or ssp:K
    backup_workers: int = 0  # sync only: apply a step once workers - backup_workers gradients arrived
    mode_schedule: str = ""  # e.g. "sync@500": switch modes when the workers reach those steps
    max_table_ids: int = 1 << 20  # most ids one lookup or sparse push may carry (a PS refuses more)
    heartbeat_s: float = 1.0  # how often a worker tells the coordinator it is alive
    heartbeat_timeout_s: float = 30.0  # a worker silent this long counts as dead (until it joins again)
    checkpoint_dir: str = ""  # where checkpoints go: a path or fsspec URL; "" turns them off
    checkpoint_every: int = 0  # steps (each worker's own count) between checkpoints; 0: none
    checkpoint_every_seconds: float = 0.0  # seconds (the chief's clock) between checkpoints; 0: none
    checkpoint_keep: int = 3  # complete checkpoints kept; older ones are deleted
    resume: int = 0  # 1: start from the latest complete checkpoint in checkpoint_dir (if any)

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0 or self.checkpoint_every_seconds < 0 or self.checkpoint_keep < 1:
            raise ConfigError(f"checkpoint options out of range: every {self.checkpoint_every} steps (>= 0), "
                              f"every {self.checkpoint_every_seconds} s (>= 0), keep {self.checkpoint_keep} (>= 1)")
        if not self.heartbeat_s > 0 or not self.heartbeat_timeout_s > 2 * self.heartbeat_s:
            raise ConfigError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed twice heartbeat_s "
                              f"({self.heartbeat_s}), which must be positive")
        if (self.checkpoint_every or self.checkpoint_every_seconds or self.resume) and not self.checkpoint_dir:
            raise ConfigError("checkpoint_every, checkpoint_every_seconds and resume need a checkpoint_dir")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Options":
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown options {unknown}; known: {sorted(known)}")
        for key, value in values.items():
            kind = str if isinstance(getattr(cls, key), str) else (int, float)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ConfigError(f"option {key!r} must be a {'string' if kind is str else 'number'}, got {value!r}")
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node needs to start; built once, then passed down."""

    cluster: ClusterSpec
    task: Task
    options: Options = field(default_factory=Options)

    def __post_init__(self) -> None:
        if self.task.type not in ROLES:
            raise ConfigError(f"task type {self.task.type!r} is not one of {list(ROLES)}")
        count = len(getattr(self.cluster, self.task.type))
        if not 0 <= self.task.index < count:
            raise ConfigError(f"task {self.task.type}:{self.task.index} is outside the cluster "
                              f"({count} {self.task.type} address(es))")

    @property
    def worker_index(self) -> int:
        """This worker's number among all workers (the chief is 0 when present)."""
        if self.task.type == "chief":
            return 0
        return len(self.cluster.chief) + self.task.index

    @property
    def address(self) -> str:
        return getattr(self.cluster, self.task.type)[self.task.index]


def bind_address(address: str) -> str:
    """Where a node listens for its cluster address: the address itself on loopback, else all interfaces."""
    host, port = address.rsplit(":", 1)
    return address if host in ("localhost", "127.0.0.1", "[::1]") else f"0.0.0.0:{port}"


def parse_tf_config(text: str, options: Options | None = None) -> NodeConfig:
    """A NodeConfig from TF_CONFIG's JSON text."""
    try:
        data = json.loads(text)
        task = data["task"]
        return NodeConfig(ClusterSpec.from_dict(data["cluster"]),
                          Task(str(task["type"]), int(task.get("index", 0))), options or Options())
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"TF_CONFIG is not valid: {exc!r}") from None


def load_cluster_file(path: str | Path, role: str, index: int, options: Options | None = None) -> NodeConfig:
    """A NodeConfig from a JSON file holding a cluster spec, or {"cluster": ..., "options": {...}}.

    Options in the file (e.g. "mode") override those from the environment.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read cluster file {path}: {exc}") from None
    spec = data.get("cluster", data) if isinstance(data, dict) else data
    options = options or Options()
    if isinstance(data, dict) and isinstance(data.get("options"), dict):
        options = Options.from_dict({**asdict(options), **data["options"]})
    return NodeConfig(ClusterSpec.from_dict(spec), Task(role, index), options)


def options_from_environ(environ: Mapping[str, str] = os.environ) -> Options:
    text = environ.get(OPTIONS_ENV)
    if not text:
        return Options()
    try:
        return Options.from_dict(json.loads(text))
    except ValueError as exc:
        raise ConfigError(f"{OPTIONS_ENV} is not valid JSON: {exc}") from None


def config_from_environ(environ: Mapping[str, str] = os.environ, options: Options | None = None) -> NodeConfig | None:
    """The node config given by TF_CONFIG, or None when TF_CONFIG is unset. Its options are `options`
    (e.g. PARAMSERVER_OPTIONS combined with command-line flags), else PARAMSERVER_OPTIONS."""
    text = environ.get(TF_CONFIG_ENV)
    if not text:
        return None
    return parse_tf_config(text, options or options_from_environ(environ))
