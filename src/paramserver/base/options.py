"""Runtime options shared by every role: one frozen dataclass, one field per option.

A field is the whole of an option: its type and default, its command-line flag with its help and
its row of docs/cli.md (base/option_fields.py), or why no flag sets it. ``paramserver`` builds its
flags from the fields (launch/cli/option_flags.py) and docs/cli.md's options tables are generated
from them (``python -m paramserver.launch.cli.docs --write docs/cli.md``). The checks of each
option's range are in base/option_checks.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from paramserver.base.codecs import usage as codec_usage
from paramserver.base.compression_spec import CompressionSpec
from paramserver.base.consistency_spec import ConsistencySpec, ModeChange, parse_schedule
from paramserver.base.errors import ConfigError
from paramserver.base.option_checks import range_problems
from paramserver.base.option_fields import CONSISTENCY, LIMITS, OPERATIONS, RUN, SECURITY, Flag, option

RECOVERIES = ("rollback", "partial")  # what a killed PS costs: the whole cluster rolls back, or its shard alone
_TUNING = "tuning, set in a cluster file's options or PARAMSERVER_OPTIONS when a deployment needs it"
_LAUNCHER = "the launcher sets it for the nodes it starts"


CODEC_WORDS = codec_usage().removeprefix("none, ")  # the registered codecs: one file each (base/codecs/)


@dataclass(frozen=True)
class Options:
    """Runtime options shared by every role. See docs/configuration.md.

    The one place options are checked: building an Options (directly, through `from_dict`, or
    `dataclasses.replace`) checks every type and range and the options' consistency with each other
    (`validate`), and raises one ConfigError naming every bad option. What needs the number of
    workers (backup workers fewer than workers) is checked by `validate(num_workers)`, which a
    NodeConfig and `paramserver run` call. Code that uses an Options trusts it.
    """

    # a flag's words read best wrapped by hand
    # fmt: off
    rpc_timeout_s: float = option(
        60.0,
        Flag("--rpc-timeout", RUN, "deadline in seconds of each call to a PS (default {default})", "S",
             doc="deadline in seconds of every call to a PS"),
    )
    connect_timeout_s: float = option(120.0, no_flag=_TUNING)  # how long a worker waits for all PS at start
    max_message_bytes: int = option(
        1 << 30,
        Flag("--max-message-bytes", LIMITS,
             "largest message sent or received (default {default}); a longer request or reply travels in several",
             "B", doc="largest message sent or received, gRPC or tensor stream; a longer request or reply "
             "travels in parts of at most this ([security.md](security.md#limits-and-bad-input))"),
    )
    max_payload_bytes: int = option(
        16 << 30,
        Flag("--max-payload-bytes", LIMITS,
             "largest request or reply put back together from its messages (default {default})", "B",
             doc="largest request or reply put back together from its parts; at least `--max-message-bytes`"),
    )
    split_bytes: int = option(256 * 1024, no_flag=_TUNING)  # variables this large are split along axis 0 across PS
    ps_threads: int = option(8, no_flag=_TUNING)  # gRPC request threads of a PS
    # TCP port of a PS's tensor stream; 0 picks a free one (announced in Hello)
    stream_port: int = option(0, no_flag="a free port, announced in Hello; `paramserver k8s` gives the gRPC port + 1")
    # pushes and pulls travel on the tensor stream (False: on gRPC); a worker on the PS's host passes
    # tensors through shared memory
    use_stream: bool = option(True, no_flag=f"for tests and measurements of the transports; {_TUNING}")
    shared_memory: bool = option(True, no_flag=f"for tests and measurements of the transports; {_TUNING}")
    torch_threads: int = option(
        0,
        Flag("--torch-threads", RUN,
             "torch intra-op threads per worker (default: the cores idle at the start / workers, at least 1)",
             "T", shown="the cores idle at the start / M, at least 1 (a PS works mostly while its workers wait; "
             "cores other processes keep busy are not counted)",
             doc="torch intra-op threads per worker; every node also gets `OMP_WAIT_POLICY=PASSIVE` unless the "
             "environment sets a wait policy (docs/performance.md)"),
    )
    progress_fd: int = option(-1, no_flag=_LAUNCHER)  # file descriptor a worker writes progress lines to; -1: none
    mode: str = option(
        "async",
        Flag("--mode", CONSISTENCY, "consistency: async (default), sync, or ssp:K (at most K steps ahead)", "MODE",
             doc="consistency: `async`, `sync` or `ssp:K` (docs/consistency.md)"),
    )
    backup_workers: int = option(
        0,
        Flag("--backup-workers", CONSISTENCY, "sync: apply a step without the last B workers", "B",
             doc="sync only: apply each step once M - B workers pushed it"),
    )
    mode_schedule: str = option(
        "",
        Flag("--mode-schedule", CONSISTENCY, "switch modes at the chief's steps, e.g. 'sync@500'", "S",
             doc="switch modes at steps, e.g. `sync@500` or `ssp:2@100,sync@900`"),
    )
    max_table_ids: int = option(1 << 20, no_flag=_TUNING)  # most ids one lookup or sparse push may carry
    heartbeat_s: float = option(1.0, no_flag=_TUNING)  # how often a worker tells the coordinator it is alive
    heartbeat_timeout_s: float = option(
        30.0,
        Flag("--heartbeat-timeout", CONSISTENCY,
             "seconds of silence after which a worker counts as dead (default {default:.0f}); a restart must "
             "rejoin within it", "S",
             doc="seconds of silence after which a worker counts as dead: waits that need it fail at once, naming "
             "it; a restarted worker must join again within it"),
    )
    checkpoint_dir: str = option(
        "",
        Flag("--checkpoint-dir", CONSISTENCY, "write checkpoints here (a path or fsspec URL, e.g. s3://b/run)", "D",
             doc="write checkpoints under D: a path, NFS, or an fsspec URL such as `s3://bucket/run` (S3 access "
             "from the environment: docs/checkpoints.md, Object storage)"),
    )
    checkpoint_every: int = option(
        0,
        Flag("--checkpoint-every", CONSISTENCY, "steps between checkpoints (each worker's count)", "N",
             shown="0 (none)", doc="steps of the chief's count between checkpoints (every worker stops at the "
             "same checkpoint, wherever it is; docs/checkpoints.md)"),
    )
    checkpoint_every_seconds: float = option(
        0.0,
        Flag("--checkpoint-every-seconds", CONSISTENCY, "seconds between checkpoints, by the chief's clock", "S",
             shown="0 (none)"),
    )
    checkpoint_keep: int = option(
        3,
        Flag("--keep", CONSISTENCY, "complete checkpoints kept (default {default})", "K",
             doc="complete checkpoints kept (with the base and deltas they need); older ones are deleted"),
    )
    checkpoint_base_every: int = option(
        8,
        Flag("--checkpoint-base-every", CONSISTENCY,
             "a whole checkpoint every K, deltas of the changed rows between (default {default}; 1: every "
             "checkpoint whole)", "K",
             doc="a whole (base) checkpoint every K; between, deltas holding only the table rows changed since "
             "the previous checkpoint (and a new base sooner when the deltas pass half the base's bytes); 1: "
             "every checkpoint whole (docs/checkpoints.md, Incremental checkpoints)"),
    )
    checkpoint_quantize: str = option(
        "none",
        Flag("--checkpoint-quantize", CONSISTENCY,
             "store embedding rows in checkpoints as bfloat16, or int8 with a float32 scale per row (default "
             "none: float32; optimizer state stays float32; docs/checkpoints.md)",
             doc="how checkpoints store embedding-table rows: float32, bfloat16, or int8 with one float32 scale "
             "per row (optimizer state stays float32; read back as float32 by resume, `checkpoint` and serving; "
             "docs/checkpoints.md, Quantized rows)"),
        choices=("none", "bf16", "int8"),
    )
    resume: bool = option(
        False,
        Flag("--resume", CONSISTENCY,
             "start from the latest complete checkpoint in --checkpoint-dir (fresh if none)",
             doc="start from the latest complete checkpoint in D (a fresh start if there is none)"),
    )
    restore_non_finite: bool = option(
        False,
        Flag("--restore-non-finite", CONSISTENCY,
             "resume from a checkpoint holding NaN or infinite values (by default it counts as damaged)"),
    )
    recovery: str = option(
        "rollback",
        Flag("--recovery", CONSISTENCY,
             "a killed PS: roll the whole cluster back to the latest checkpoint (rollback, the default), or "
             "restore its shard alone from its newest checkpoint while the rest goes on (partial; async mode)",
             doc="what a PS killed by a signal costs, with D: `rollback` sends the whole cluster back to the "
             "latest checkpoint; `partial` restarts that PS alone, restoring its shard from its newest "
             "checkpoint, while the other shards keep their state and the workers their data positions (async "
             "mode; the closing line's `partial_recoveries` says the steps that shard lost; without a checkpoint "
             "yet, in another mode, or for the chief, the run rolls back and says why; docs/recovery.md, "
             "Partial recovery)"),
        choices=RECOVERIES,
    )
    # communication (docs/performance.md)
    compression: str = option(
        "",
        Flag("--compression", LIMITS,
             f"gradient compression: a codec for all ({CODEC_WORDS}) or PATTERN=CODEC rules, "
             "comma-separated (docs/performance.md)", "C",
             doc=f"gradient compression: one codec for every gradient ({CODEC_WORDS}) or "
             "`PATTERN=CODEC` rules, comma-separated ([performance.md](performance.md), \"Gradient compression\")"),
    )
    dense_sync: str = option(
        "ps",
        Flag("--dense-sync", LIMITS, "dense variables: pushed to the PS (default) or all-reduced among the workers",
             doc="dense variables: pushed to the PS, or all-reduced among the workers "
             "([performance.md](performance.md))"),
        choices=("ps", "allreduce"),
    )
    # an evaluator ends after this long without a new checkpoint; 0: at the final one
    eval_timeout_s: float = option(0.0, no_flag="an evaluator's own; set in PARAMSERVER_OPTIONS or a cluster file")
    # limits a PS enforces before it takes memory (docs/security.md)
    max_table_rows: int = option(
        1 << 27,
        Flag("--max-table-rows", LIMITS, "most rows of one table on one PS (default {default})", "N",
             doc="most rows one table may hold on one PS: a registration's capacity and the rows lookups create "
             "([security.md](security.md#limits-and-bad-input))"),
    )
    max_table_memory_bytes: int = option(
        16 << 30,
        Flag("--max-table-memory", LIMITS, "most bytes of all tables on one PS, e.g. 16GiB (default {default})", "B",
             doc="most bytes all tables (and new dense groups) of one PS may hold, checked before memory is "
             "taken: a number of bytes, or `16GiB`, `512MiB`", byte_size=True),
    )
    max_tiered_table_rows: int = option(
        1 << 34,
        Flag("--max-tiered-table-rows", LIMITS,
             "with --table-memory-budget: most rows of one table on one PS, memory and disk (default {default})",
             "N", doc="with a budget: most rows of one table on one PS, memory and disk (instead of "
             "`--max-table-rows`)"),
    )
    max_gradient_magnitude: float = option(
        1e15,
        Flag("--max-gradient-magnitude", LIMITS,
             "refuse a pushed gradient holding a value larger than this in magnitude, like NaN (default {default:g})",
             "X", doc="a pushed gradient holding a value larger than X in magnitude is refused, like NaN"),
    )
    # tables bigger than memory (docs/scaling.md#tiered-tables)
    table_memory_budget: int = option(
        0,
        Flag("--table-memory-budget", LIMITS,
             "bytes of table rows one PS keeps in memory, e.g. 4GiB; the rest go to --spill-dir (default 0: all "
             "in memory; docs/scaling.md)", "B", shown="0 (off)",
             doc="tables bigger than memory: each PS keeps B bytes of table rows in memory (`4GiB`, `512MiB`, "
             "`1.5GB`, or a number of bytes) and the rest in `--spill-dir`; each needs the other "
             "([scaling.md](scaling.md#tiered-tables))", byte_size=True),
    )
    spill_dir: str = option(
        "",
        Flag("--spill-dir", LIMITS,
             "local directory where a PS with --table-memory-budget keeps the rows beyond it (each PS in a "
             "subdirectory of its own, deleted when it stops)", "D",
             doc="local directory where a PS with a `--table-memory-budget` keeps the rows beyond it, in a "
             "subdirectory of its own deleted when it stops"),
    )
    idle_timeout_s: float = option(
        300.0,
        Flag("--idle-timeout", LIMITS,
             "seconds after which an idle tensor-stream connection is closed (default {default:.0f})", "S",
             doc="seconds after which a tensor-stream connection without a request is closed (the client "
             "reconnects on its next call)"),
    )
    max_connections: int = option(
        256,
        Flag("--max-connections", LIMITS, "tensor-stream connections per PS (default {default})", "N",
             doc="tensor-stream connections one PS serves at once; one more is refused"),
    )
    # operations (docs/operations.md)
    metrics_port: int = option(
        -1,
        Flag("--metrics-port", OPERATIONS, "serve Prometheus metrics on this port (0: a free one)", "P",
             shown="none", doc="serve Prometheus metrics on port P (0: a free one, logged; "
             "[operations.md](operations.md#metrics-prometheus)); `run` takes `0` only: its nodes share this "
             "host, each gets a free port of its own"),
    )
    metrics_bind: str = option(
        "127.0.0.1",
        Flag("--metrics-bind", OPERATIONS,
             "host the metrics endpoint listens on (default {default}; 0.0.0.0: every interface)", "HOST",
             doc="the host the metrics endpoints listen on (`0.0.0.0`: every interface; `paramserver k8s` sets "
             "it)"),
    )
    log_format: str = option(
        "text",
        Flag("--log-format", OPERATIONS, "log lines: text (default) or json",
             doc="`text` (human lines) or `json` (JSON lines naming node, role, event, duration_s) for the "
             "launcher and every node ([operations.md](operations.md#logs))"),
        choices=("text", "json"),
    )
    logdir: str = option(
        "",
        Flag("--logdir", OPERATIONS, "the chief writes TensorBoard summaries here", "D",
             doc="the chief writes TensorBoard event files into D ([operations.md](operations.md#tensorboard))"),
    )
    summary_every: int = option(
        100,
        Flag("--summary-every", OPERATIONS, "steps between TensorBoard summaries (default {default})", "N",
             doc="steps of the chief between TensorBoard summaries"),
    )
    audit_log: str = option(
        "",
        Flag("--audit-log", OPERATIONS, "append the audit trail (JSON lines) to this file (PS, coordinator)", "FILE",
             shown="the node's log",
             doc="PS and coordinator append their audit trail (JSON lines) to FILE (docs/security.md)"),
    )
    # the chief ends every PS (exit 0) once the run completed
    stop_ps_at_end: bool = option(False, no_flag="`paramserver k8s` sets it, so that every Job completes")
    drain_grace_s: float = option(
        10.0,
        Flag("--drain-grace", OPERATIONS,
             "SIGTERM: seconds for calls in flight to finish (default {default:.0f})", "S",
             doc="SIGTERM: seconds a PS gives calls in flight, after its health went NOT_SERVING"),
    )
    # (within Kubernetes' terminationGracePeriodSeconds, 30 by default)
    preempt_grace_s: float = option(
        20.0,
        Flag("--preempt-grace", OPERATIONS,
             "with --checkpoint-dir, SIGTERM or a first Ctrl-C writes a checkpoint at the next step, then stops: "
             "seconds it may take (default {default:.0f})", "S",
             doc="with `--checkpoint-dir`: SIGTERM or a first Ctrl-C writes a checkpoint at the workers' next "
             "step, then stops; seconds that may take"),
    )
    # security (docs/security.md)
    tls_cert: str = option(
        "",
        Flag("--tls-cert", SECURITY, "this node's PEM certificate (TLS on every channel)", "F",
             doc="this node's PEM certificate: TLS on every channel, with `--tls-key`; `run` gives it to every "
             "node (`--certs` gives each its own)"),
    )
    tls_key: str = option("", Flag("--tls-key", SECURITY, "this node's PEM private key", "F"))
    tls_ca: str = option(
        "",
        Flag("--tls-ca", SECURITY, "PEM CA bundle: both ends verify each other (mutual TLS)", "F",
             doc="PEM CA bundle: both ends verify each other (mutual TLS; needs `--tls-cert` and `--tls-key`)"),
    )
    auth_tokens: str = option(
        "",
        Flag("--auth-tokens", SECURITY, "JSON file of accepted tokens and their roles (servers)", "FILE",
             doc="a PS / the coordinator accepts only calls with a token from this store (docs/security.md); "
             "`run --tokens` sets it"),
    )
    token_file: str = option(
        "",
        Flag("--token-file", SECURITY, "file holding the token this node presents", "FILE",
             doc="the token this node presents on every call; `run --tokens` sets it per node"),
    )
    # file holding the secret of the `paramserver run` that started this node (Prove)
    run_secret_file: str = option("", no_flag=_LAUNCHER)
    # fmt: on

    def __post_init__(self) -> None:
        badly_typed = self._type_problems()
        for f in fields(self):  # an int given for a float option becomes a float: one type per option
            if f.type == "float" and f.name not in badly_typed:
                object.__setattr__(self, f.name, float(getattr(self, f.name)))
        problems = list(badly_typed.values()) + range_problems(self, None, skip=set(badly_typed))
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
        problems = range_problems(self, num_workers)
        if problems:
            raise ConfigError("; ".join(problems))

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
