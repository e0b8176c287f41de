"""Typed configuration of a node: the cluster, this node's task, and runtime options.

Read once when a node starts, from one of:
- ``TF_CONFIG`` (TensorFlow / Kubeflow TFJob JSON: {"cluster": {...}, "task": {"type", "index"}}),
  including the sparse form a TFJob with ``enableDynamicWorker`` writes ({"sparseCluster": ...}),
  which names only part of the cluster: the rest comes from a cluster file or PARAMSERVER_CLUSTER;
- a cluster file (or ``PARAMSERVER_CLUSTER``, the same JSON) plus ``--role`` / ``--index`` flags,
  or the task that TF_CONFIG names;
and ``PARAMSERVER_OPTIONS`` (JSON of :class:`Options`, set by ``paramserver run``; the options
themselves are declared in base/options/options.py, and imported from here too).
Nothing below this module reads the environment.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paramserver.base.errors import ConfigError
from paramserver.base.options.options import Options

ROLES = ("chief", "worker", "ps")
EVALUATOR = "evaluator"  # TF's sidecar evaluator: outside the training cluster, follows its checkpoints
TASK_TYPES = (*ROLES, EVALUATOR)
LEGACY_CHIEF = "master"  # TF1's name for the chief, still written by Kubeflow's TFJob for a Master replica
OPTIONS_ENV = "PARAMSERVER_OPTIONS"
TF_CONFIG_ENV = "TF_CONFIG"
CLUSTER_ENV = "PARAMSERVER_CLUSTER"  # a whole cluster spec (JSON), as in a cluster file


@dataclass(frozen=True)
class ClusterSpec:
    """Addresses ("host:port") of every node, by role. A chief, if present, is worker number 0.
    Evaluators are listed but are not workers: they never train and nothing waits for them."""

    ps: tuple[str, ...] = ()
    worker: tuple[str, ...] = ()
    chief: tuple[str, ...] = ()
    evaluator: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> ClusterSpec:
        if not isinstance(spec, Mapping):
            raise ConfigError(f"cluster spec must be an object of role -> address list, got {spec!r}")
        if LEGACY_CHIEF in spec:  # {"master": [...]} is the chief
            if spec.get("chief"):
                raise ConfigError("a cluster spec names a chief under both 'chief' and 'master'; give one")
            spec = {**{k: v for k, v in spec.items() if k != LEGACY_CHIEF}, "chief": spec[LEGACY_CHIEF]}
        unknown = sorted(set(spec) - set(TASK_TYPES) - {"options"})
        if unknown:
            raise ConfigError(f"cluster spec has unknown roles {unknown}; known: {list(TASK_TYPES)}")
        lists = {}
        for role in TASK_TYPES:
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
        return {role: list(getattr(self, role)) for role in TASK_TYPES if getattr(self, role)}

    @property
    def num_workers(self) -> int:
        return len(self.chief) + len(self.worker)


@dataclass(frozen=True)
class Task:
    """This node's role and index within that role."""

    type: str
    index: int


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node needs to start; built once, then passed down."""

    cluster: ClusterSpec
    task: Task
    options: Options = field(default_factory=Options)
    own_address: str | None = None  # an elastic run's worker the cluster does not list: its address, if known

    def __post_init__(self) -> None:
        if self.task.type not in TASK_TYPES:
            raise ConfigError(f"task type {self.task.type!r} is not one of {list(TASK_TYPES)}")
        count = len(getattr(self.cluster, self.task.type))
        unlisted_evaluator = self.task.type == EVALUATOR and count == 0  # it serves nothing: needs no address
        if self.task.index < 0 or not unlisted_evaluator and self.task.index >= count and not self._joins():
            raise ConfigError(
                f"task {self.task.type}:{self.task.index} is outside the cluster ({count} {self.task.type} address(es))"
                + (
                    f"; an elastic run takes worker indices below {self.num_workers - len(self.cluster.chief)}"
                    if self.options.max_workers
                    else ""
                )
            )
        self.options.validate(self.cluster.num_workers)

    def _joins(self) -> bool:
        """An elastic run's worker the cluster spec does not list (TF_CONFIG with no worker list, or a
        new index): it joins the coordinator, within the run's `max_workers` slots."""
        return self.task.type == "worker" and self.options.max_workers > 0 and self.worker_index < self.num_workers

    @property
    def num_workers(self) -> int:
        """The cluster's workers: those listed, or an elastic run's `max_workers` slots."""
        return self.options.max_workers or self.cluster.num_workers

    @property
    def worker_index(self) -> int:
        """This worker's number among all workers (the chief is 0 when present)."""
        if self.task.type == "chief":
            return 0
        return len(self.cluster.chief) + self.task.index

    @property
    def address(self) -> str | None:
        """This node's own address; None for an evaluator the cluster spec does not list."""
        addresses = getattr(self.cluster, self.task.type)
        return addresses[self.task.index] if self.task.index < len(addresses) else self.own_address

    def listed_address(self) -> str:
        """This node's own address, for a node that serves one (every node but an unlisted evaluator)."""
        address = self.address
        if address is None:
            raise ConfigError(f"task {self.task.type}:{self.task.index} has no address in the cluster")
        return address


def bind_address(address: str) -> str:
    """Where a node listens for its cluster address: the address itself on loopback, else all interfaces."""
    host, port = address.rsplit(":", 1)
    return address if host in ("localhost", "127.0.0.1", "[::1]") else f"0.0.0.0:{port}"


def parse_tf_config(text: str, options: Options | None = None, cluster: ClusterSpec | None = None) -> NodeConfig:
    """A NodeConfig from TF_CONFIG's JSON text.

    The sparse form (a TFJob with enableDynamicWorker: {"sparseCluster": {"ps": [...], "worker":
    {"3": "host:port"}}, ...}, or "cluster" with a worker object) names only part of the cluster;
    `cluster` (a cluster file or PARAMSERVER_CLUSTER) gives the whole, and must agree with it.
    """
    try:
        data = json.loads(text)
        task = data["task"]
        task = Task(str(task["type"]), int(task.get("index", 0)))
        if task.type == LEGACY_CHIEF:
            task = Task("chief", task.index)
        spec = data["sparseCluster"] if "sparseCluster" in data else data["cluster"]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"TF_CONFIG is not valid: {exc!r}") from None
    if "sparseCluster" in data or isinstance(spec, Mapping) and isinstance(spec.get("worker"), Mapping):
        options = options or Options()
        whole = _whole_cluster(spec, task, cluster, options.max_workers > 0)
        unlisted = task.type == "worker" and task.index >= len(whole.worker)
        own = (spec.get("worker") or {}).get(str(task.index)) if unlisted else None
        return NodeConfig(whole, task, options, own if isinstance(own, str) else None)
    # the cluster's, the task's and the options' own errors say what is wrong themselves
    return NodeConfig(ClusterSpec.from_dict(spec), task, options or Options())


def _whole_cluster(sparse: Any, task: Task, cluster: ClusterSpec | None, elastic: bool = False) -> ClusterSpec:
    """The whole cluster behind TF_CONFIG's sparse form, checked against what the form names (in an
    elastic run a worker beyond those listed joins: NodeConfig checks its index)."""
    if not isinstance(sparse, Mapping):
        raise ConfigError(f"TF_CONFIG's sparse cluster must be an object, got {sparse!r}")
    if cluster is None:
        raise ConfigError(
            "TF_CONFIG has the sparse cluster form (a TFJob with enableDynamicWorker), which names "
            "neither the other workers nor the chief; give the whole cluster too: --cluster FILE or "
            f"{CLUSTER_ENV} (paramserver k8s --tfjob writes it)"
        )
    workers, ps = sparse.get("worker") or {}, sparse.get("ps") or []
    if not isinstance(workers, Mapping) or not all(
        isinstance(i, str) and i.isdigit() and isinstance(a, str) for i, a in workers.items()
    ):
        raise ConfigError(f"TF_CONFIG's sparse cluster: 'worker' must map indexes to 'host:port', got {workers!r}")
    if not isinstance(ps, list) or not all(isinstance(a, str) for a in ps):
        raise ConfigError(f"TF_CONFIG's sparse cluster: 'ps' must be a list of 'host:port', got {ps!r}")
    named = {("worker", int(index)): address for index, address in workers.items()}
    if task.type == "ps" and len(ps) == 1:  # a PS's sparse form lists only itself
        named[("ps", task.index)] = ps[0]
    else:
        named.update({("ps", index): address for index, address in enumerate(ps)})
    for (role, index), address in named.items():
        listed = getattr(cluster, role)
        if elastic and role == "worker" and index >= len(listed):
            continue
        if index >= len(listed) or listed[index] != address:
            raise ConfigError(
                f"TF_CONFIG names {role}:{index} at {address}, but the whole cluster given "
                f"has {listed[index] if index < len(listed) else 'no such task'}"
            )
    return cluster


def cluster_from_text(text: str, source: str) -> ClusterSpec:
    """A ClusterSpec from a cluster file's JSON: a spec, or {"cluster": spec, "options": {...}}."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{source} is not valid JSON: {exc}") from None
    spec = data.get("cluster", data) if isinstance(data, dict) else data
    return ClusterSpec.from_dict(spec)


def load_cluster_file(path: str | Path, role: str, index: int, options: Options | None = None) -> NodeConfig:
    """A NodeConfig from a JSON file holding a cluster spec, or {"cluster": ..., "options": {...}}.

    Options in the file (e.g. "mode") override those from the environment.
    """
    cluster, options = read_cluster_file(path, options)
    return NodeConfig(cluster, Task(role, index), options)


def read_cluster_file(path: str | Path, options: Options | None = None) -> tuple[ClusterSpec, Options]:
    """A cluster file's spec, and `options` with the file's own options laid over them."""
    try:
        text = Path(path).read_text()
        data = json.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read cluster file {path}: {exc}") from None
    options = options or Options()
    if isinstance(data, dict) and isinstance(data.get("options"), dict):
        options = Options.from_dict({**asdict(options), **data["options"]})
    return cluster_from_text(text, f"cluster file {path}"), options


def options_from_environ(environ: Mapping[str, str] = os.environ) -> Options:
    text = environ.get(OPTIONS_ENV)
    if not text:
        return Options()
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{OPTIONS_ENV} is not valid JSON: {exc}") from None
    return Options.from_dict(values)


def config_from_environ(
    environ: Mapping[str, str] = os.environ, options: Options | None = None, cluster: ClusterSpec | None = None
) -> NodeConfig | None:
    """The node config given by TF_CONFIG, or None when TF_CONFIG is unset. Its options are `options`
    (e.g. PARAMSERVER_OPTIONS combined with command-line flags), else PARAMSERVER_OPTIONS. A sparse
    TF_CONFIG takes the whole cluster from `cluster`, else from PARAMSERVER_CLUSTER."""
    text = environ.get(TF_CONFIG_ENV)
    if not text:
        return None
    if cluster is None and environ.get(CLUSTER_ENV):
        cluster = cluster_from_text(environ[CLUSTER_ENV], CLUSTER_ENV)
    return parse_tf_config(text, options or options_from_environ(environ), cluster)
