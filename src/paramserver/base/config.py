"""Typed configuration of a node: the cluster, this node's task, and runtime options.

Read once when a node starts, from one of:
- ``TF_CONFIG`` (TensorFlow / Kubeflow TFJob JSON: {"cluster": {...}, "task": {"type", "index"}}),
  including the sparse form a TFJob with ``enableDynamicWorker`` writes ({"sparseCluster": ...}),
  which names only part of the cluster: the rest comes from a cluster file or PARAMSERVER_CLUSTER;
- a cluster file (or ``PARAMSERVER_CLUSTER``, the same JSON) plus ``--role`` / ``--index`` flags,
  or the task that TF_CONFIG names;
and ``PARAMSERVER_OPTIONS`` (JSON of :class:`Options`, set by ``paramserver run``).
Nothing below this module reads the environment.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from paramserver.base.compression_spec import CompressionSpec
from paramserver.base.consistency_spec import ConsistencySpec, ModeChange, parse_schedule
from paramserver.base.errors import ConfigError, InvalidArgumentError

ROLES = ("chief", "worker", "ps")
EVALUATOR = "evaluator"  # TF's sidecar evaluator: outside the training cluster, follows its checkpoints
TASK_TYPES = (*ROLES, EVALUATOR)
LEGACY_CHIEF = "master"  # TF1's name for the chief, still written by Kubeflow's TFJob for a Master replica
OPTIONS_ENV = "PARAMSERVER_OPTIONS"
TF_CONFIG_ENV = "TF_CONFIG"
CLUSTER_ENV = "PARAMSERVER_CLUSTER"  # a whole cluster spec (JSON), as in a cluster file
_HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252})")


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


_GRPC_MAX_MESSAGE = 2**31 - 1  # gRPC's message size limits are signed 32-bit
MIN_TABLE_MEMORY_BUDGET = 1 << 16  # the least table_memory_budget (a few hundred rows in memory)


RECOVERIES = ("rollback", "partial")  # what a killed PS costs: the whole cluster rolls back, or its shard alone


@dataclass(frozen=True)
class Options:
    """Runtime options shared by every role. See docs/configuration.md.

    The one place options are checked: building an Options (directly, through `from_dict`, or
    `dataclasses.replace`) checks every type and range and the options' consistency with each other
    (`validate`), and raises one ConfigError naming every bad option. What needs the number of
    workers (backup workers fewer than workers) is checked by `validate(num_workers)`, which a
    NodeConfig and `paramserver run` call. Code that uses an Options trusts it.
    """

    rpc_timeout_s: float = 60.0  # deadline of every call to a PS
    connect_timeout_s: float = 120.0  # how long a worker waits for all PS at start
    max_message_bytes: int = 1 << 30  # largest message on the wire; a larger payload is split into several
    max_payload_bytes: int = 16 << 30  # largest request or reply put back together from its messages
    split_bytes: int = 256 * 1024  # variables this large are split along axis 0 across PS
    ps_threads: int = 8  # gRPC request threads of a PS
    stream_port: int = 0  # TCP port of a PS's tensor stream; 0 picks a free one (announced in Hello)
    use_stream: bool = True  # pushes and pulls travel on the tensor stream (False: on gRPC)
    shared_memory: bool = True  # a worker on the PS's host passes tensors through shared memory
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
    checkpoint_keep: int = 3  # complete checkpoints kept (with the base and deltas they need); older ones are deleted
    checkpoint_base_every: int = 8  # a whole (base) checkpoint every K, deltas between; 1: every one whole
    checkpoint_quantize: str = "none"  # table rows in checkpoints: "none" (float32), "bf16", "int8" (+ a row's scale)
    resume: bool = False  # start from the latest complete checkpoint in checkpoint_dir (if any)
    restore_non_finite: bool = False  # resume from a checkpoint holding NaN or infinite values (refused otherwise)
    recovery: str = "rollback"  # a killed PS: "rollback" (the whole cluster) or "partial" (its shard alone)
    # communication (docs/performance.md)
    compression: str = ""  # gradient compression rules, e.g. "fp16" or "mlp.*=int8,emb=bf16"; "": none
    dense_sync: str = "ps"  # dense variables: "ps" (pushed to the PS) or "allreduce" (among workers, gloo)
    eval_timeout_s: float = 0.0  # an evaluator ends after this long without a new checkpoint; 0: at the final one
    # limits a PS enforces before it takes memory (docs/security.md)
    max_table_rows: int = 1 << 27  # most rows one table may hold on one PS (capacity asked, or rows created)
    max_table_memory_bytes: int = 16 << 30  # most bytes all tables (and new dense groups) of one PS may hold
    max_tiered_table_rows: int = 1 << 34  # most rows one tiered table may hold on one PS, memory and disk
    max_gradient_magnitude: float = 1e15  # a pushed gradient value larger than this in magnitude is refused, like NaN
    # tables bigger than memory (docs/scaling.md#tiered-tables)
    table_memory_budget: int = 0  # bytes of table rows one PS keeps in memory, the rest in spill_dir; 0: all in memory
    spill_dir: str = ""  # local directory a PS with a table_memory_budget keeps the other rows in
    idle_timeout_s: float = 300.0  # a tensor-stream connection with no request this long is closed
    max_connections: int = 256  # tensor-stream connections one PS serves at once
    # operations (docs/operations.md)
    metrics_port: int = -1  # Prometheus endpoint of this node; -1: none, 0: a free port (logged)
    metrics_bind: str = "127.0.0.1"  # host the metrics endpoint listens on (paramserver k8s sets 0.0.0.0)
    log_format: str = "text"  # "text" (human lines) or "json" (JSON lines)
    logdir: str = ""  # TensorBoard event files, written by the chief; "" turns them off
    summary_every: int = 100  # steps between TensorBoard summaries
    audit_log: str = ""  # append-only JSON-lines audit file of a PS / the coordinator; "": the node's log
    stop_ps_at_end: bool = False  # the chief ends every PS (exit 0) once the run completed (paramserver k8s sets it)
    drain_grace_s: float = 10.0  # SIGTERM: seconds for calls in flight to finish before the node stops
    # SIGTERM or a first Ctrl-C on a worker, with a checkpoint_dir: seconds for the checkpoint at the next step
    # (within Kubernetes' terminationGracePeriodSeconds, 30 by default)
    preempt_grace_s: float = 20.0
    # security (docs/security.md)
    tls_cert: str = ""  # PEM certificate of this node; with tls_key, every channel uses TLS
    tls_key: str = ""  # PEM private key of tls_cert
    tls_ca: str = ""  # PEM CA bundle; with it both ends verify each other (mutual TLS)
    auth_tokens: str = ""  # server side: JSON file of accepted tokens and their roles; "": no token checks
    token_file: str = ""  # client side: file holding the token this node presents
    run_secret_file: str = ""  # file holding the secret of the `paramserver run` that started this node (Prove)

    def __post_init__(self) -> None:
        badly_typed = self._type_problems()
        for f in fields(self):  # an int given for a float option becomes a float: one type per option
            if f.type == "float" and f.name not in badly_typed:
                object.__setattr__(self, f.name, float(getattr(self, f.name)))
        problems = list(badly_typed.values()) + self._range_problems(None, skip=set(badly_typed))
        if problems:
            raise ConfigError("; ".join(problems))

    def _type_problems(self) -> dict[str, str]:
        problems = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                ok, want = isinstance(value, bool), "true or false"
            elif f.type == "str":
                ok, want = isinstance(value, str), "a string"
            elif f.type == "int":
                ok, want = isinstance(value, int) and not isinstance(value, bool), "an integer"
            elif f.type == "float":
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                want = "a finite number"
            else:  # a new option of another type: give it its check here
                raise TypeError(f"Options.{f.name}: no check for type {f.type}")
            if not ok:
                problems[f.name] = f"option {f.name!r} must be {want}, got {value!r}"
        return problems

    def validate(self, num_workers: int | None = None) -> None:
        """Check every range and the options' consistency (building an Options did); with
        `num_workers`, also against the cluster's size. Raises one ConfigError naming every bad option."""
        problems = self._range_problems(num_workers)
        if problems:
            raise ConfigError("; ".join(problems))

    def _range_problems(self, num_workers: int | None, skip: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Problems of the well-typed options (those in `skip` are not), each naming its option."""
        found: list[str] = []

        def need(name: str, ok: Callable[[Any], bool], rule: str) -> None:
            if name not in skip and not ok(getattr(self, name)):
                found.append(f"option {name!r} must be {rule}, got {getattr(self, name)!r}")

        def needs(name: str, *others: str) -> bool:  # may a check of `name` that reads `others` run?
            return not skip.intersection((name, *others))

        for name in ("rpc_timeout_s", "connect_timeout_s", "heartbeat_s", "max_gradient_magnitude"):
            need(name, lambda v: v > 0, "positive")
        need("max_message_bytes", lambda v: 1024 <= v <= _GRPC_MAX_MESSAGE, f"between 1024 and {_GRPC_MAX_MESSAGE}")
        if needs("max_payload_bytes", "max_message_bytes"):
            need(
                "max_payload_bytes",
                lambda v: v >= self.max_message_bytes,
                f"at least max_message_bytes ({self.max_message_bytes})",
            )
        need("split_bytes", lambda v: v >= 1, "at least 1")
        need("ps_threads", lambda v: v >= 1, "at least 1")
        need("stream_port", lambda v: 0 <= v <= 65535, "a port number from 0 to 65535")
        need("torch_threads", lambda v: v >= 0, "0 (torch's default) or more")
        need("progress_fd", lambda v: v >= -1, "-1 (none) or a file descriptor")
        need("backup_workers", lambda v: v >= 0, "0 or more")
        need("max_table_ids", lambda v: v >= 1, "at least 1")
        need("checkpoint_every", lambda v: v >= 0, "0 (none) or more")
        need("checkpoint_every_seconds", lambda v: v >= 0, "0 (none) or more")
        need("checkpoint_keep", lambda v: v >= 1, "at least 1")
        need("checkpoint_base_every", lambda v: v >= 1, "at least 1 (1: every checkpoint whole)")
        need("checkpoint_quantize", lambda v: v in ("none", "bf16", "int8"), "'none', 'bf16' or 'int8'")
        need("eval_timeout_s", lambda v: v >= 0, "0 (wait for the final checkpoint) or more")
        for name in ("max_table_rows", "max_table_memory_bytes", "max_tiered_table_rows"):
            need(name, lambda v: v >= 1, "at least 1")
        for name in ("max_connections", "summary_every"):
            need(name, lambda v: v >= 1, "at least 1")
        found += self._tier_problems(skip)
        for name in ("idle_timeout_s", "drain_grace_s", "preempt_grace_s"):
            need(name, lambda v: v > 0, "positive")
        need("metrics_port", lambda v: -1 <= v <= 65535, "-1 (none), 0 (a free port) or a port number")
        need("metrics_bind", _is_host, "a host name or IP address to listen on, e.g. 127.0.0.1, 0.0.0.0 or ::")
        need("log_format", lambda v: v in ("text", "json"), "'text' or 'json'")
        need("dense_sync", lambda v: v in ("ps", "allreduce"), "'ps' or 'allreduce'")
        need("recovery", lambda v: v in RECOVERIES, "'rollback' or 'partial'")
        if "compression" not in skip:
            try:
                CompressionSpec.parse(self.compression)
            except InvalidArgumentError as exc:
                found.append(f"option 'compression' is not valid: {exc}")
        for name, other in (("tls_cert", "tls_key"), ("tls_key", "tls_cert")):
            if needs(name, other) and getattr(self, name) and not getattr(self, other):
                found.append(f"option {name!r} needs {other} too")
        if needs("tls_ca", "tls_cert") and self.tls_ca and not self.tls_cert:
            found.append("option 'tls_ca' needs 'tls_cert' and 'tls_key' (mutual TLS: every node shows its own)")
        if needs("heartbeat_timeout_s", "heartbeat_s") and self.heartbeat_s > 0:
            need(
                "heartbeat_timeout_s",
                lambda v: v > 2 * self.heartbeat_s,
                f"more than twice heartbeat_s ({self.heartbeat_s})",
            )
        if needs("dense_sync") and self.dense_sync == "allreduce":
            # a timed checkpoint pauses each worker after whichever step it learns of it (a step count's
            # pauses all at that step), and backup workers leave steps behind: the all-reduces must meet
            if needs("checkpoint_every_seconds") and self.checkpoint_every_seconds:
                found.append(
                    "option 'checkpoint_every_seconds' needs dense_sync 'ps' (with 'allreduce' the "
                    "workers must pause at the same step: use checkpoint_every)"
                )
            if needs("backup_workers") and self.backup_workers:
                found.append(
                    "option 'backup_workers' needs dense_sync 'ps' (the dense all-reduce waits for every worker)"
                )
        for name in ("checkpoint_every", "checkpoint_every_seconds", "resume"):
            if needs(name, "checkpoint_dir") and getattr(self, name) and not self.checkpoint_dir:
                found.append(f"option {name!r} needs a checkpoint_dir")
        if needs("recovery", "checkpoint_dir") and self.recovery == "partial" and not self.checkpoint_dir:
            found.append("option 'recovery' 'partial' needs a checkpoint_dir (the lost shard is restored from it)")
        return found + self._mode_problems(num_workers, skip)

    def _tier_problems(self, skip: frozenset[str] | set[str]) -> list[str]:
        """table_memory_budget and spill_dir: both or neither, and a budget the tables may take."""
        found = []
        budget = self.table_memory_budget
        if "table_memory_budget" not in skip:
            if budget != 0 and budget < MIN_TABLE_MEMORY_BUDGET:
                least = MIN_TABLE_MEMORY_BUDGET
                found.append(f"option 'table_memory_budget' must be 0 (off) or at least {least}, got {budget!r}")
            elif "max_table_memory_bytes" not in skip and budget > self.max_table_memory_bytes:
                found.append(
                    f"option 'table_memory_budget' must be at most max_table_memory_bytes "
                    f"({self.max_table_memory_bytes}), got {budget!r}"
                )
            elif budget and "spill_dir" not in skip and not self.spill_dir:
                found.append("option 'table_memory_budget' needs a spill_dir (where the rows beyond it go)")
        if not skip.intersection(("spill_dir", "table_memory_budget")) and self.spill_dir and not budget:
            found.append("option 'spill_dir' needs a table_memory_budget (rows spill only beyond a budget)")
        return found

    def _mode_problems(self, num_workers: int | None, skip: frozenset[str] | set[str]) -> list[str]:
        """mode, backup_workers and mode_schedule, as ConsistencySpec and the schedule read them."""
        found = []
        if skip.intersection(("mode", "backup_workers")):
            workers = 1
        else:  # unknown: as many as the backups allow
            workers = num_workers if num_workers is not None else max(self.backup_workers + 1, 1)
        if needs_mode := "mode" not in skip:
            try:
                ConsistencySpec.parse(self.mode, max(workers, 1))
            except InvalidArgumentError as exc:
                found.append(f"option 'mode' is not valid: {exc}")
                needs_mode = False
        if needs_mode and "backup_workers" not in skip and self.backup_workers > 0:
            try:
                ConsistencySpec.parse(self.mode, workers, self.backup_workers)
            except InvalidArgumentError as exc:
                found.append(f"option 'backup_workers' is not valid: {exc}")
        if "mode_schedule" not in skip:
            try:
                for change in parse_schedule(self.mode_schedule):
                    ConsistencySpec.parse(change.mode, max(workers, 1))
            except InvalidArgumentError as exc:
                found.append(f"option 'mode_schedule' is not valid: {exc}")
        return found

    def consistency(self, num_workers: int) -> ConsistencySpec:
        """The consistency spec these options give a cluster of `num_workers` workers."""
        self.validate(num_workers)
        return ConsistencySpec.parse(self.mode, num_workers, self.backup_workers)

    @property
    def compression_spec(self) -> CompressionSpec:
        """`compression`, parsed."""
        return CompressionSpec.parse(self.compression)

    @property
    def mode_changes(self) -> list[ModeChange]:
        """`mode_schedule`, parsed."""
        return parse_schedule(self.mode_schedule)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Options:
        """Options from JSON-like values (PARAMSERVER_OPTIONS, a cluster file's "options").

        Boolean options take true / false, and also 1 / 0 (what the files and environments written
        before they were booleans hold); any other value is refused, naming the option.
        """
        if not isinstance(values, Mapping):
            raise ConfigError(f"options must be an object of name -> value, got {values!r}")
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown options {unknown}; known: {sorted(known)}")
        values = {key: _legacy_bool(value) if known[key] == "bool" else value for key, value in values.items()}
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _legacy_bool(value: Any) -> Any:
    """1 / 0 as True / False (an int exactly; 1.0 or "1" stay as they are, and are refused)."""
    if type(value) is int and value in (0, 1):
        return bool(value)
    return value


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node needs to start; built once, then passed down."""

    cluster: ClusterSpec
    task: Task
    options: Options = field(default_factory=Options)

    def __post_init__(self) -> None:
        if self.task.type not in TASK_TYPES:
            raise ConfigError(f"task type {self.task.type!r} is not one of {list(TASK_TYPES)}")
        count = len(getattr(self.cluster, self.task.type))
        unlisted_evaluator = self.task.type == EVALUATOR and count == 0  # it serves nothing: needs no address
        if self.task.index < 0 or not unlisted_evaluator and self.task.index >= count:
            raise ConfigError(
                f"task {self.task.type}:{self.task.index} is outside the cluster ({count} {self.task.type} address(es))"
            )
        self.options.validate(self.cluster.num_workers)

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
        return addresses[self.task.index] if self.task.index < len(addresses) else None

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
        return NodeConfig(_whole_cluster(spec, task, cluster), task, options or Options())
    # the cluster's, the task's and the options' own errors say what is wrong themselves
    return NodeConfig(ClusterSpec.from_dict(spec), task, options or Options())


def _whole_cluster(sparse: Any, task: Task, cluster: ClusterSpec | None) -> ClusterSpec:
    """The whole cluster behind TF_CONFIG's sparse form, checked against what the form names."""
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


def _is_host(value: str) -> bool:
    """An IP address, or a host name (letters, digits, '-', '.'): what a server may listen on."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return bool(_HOST_NAME.fullmatch(value))
