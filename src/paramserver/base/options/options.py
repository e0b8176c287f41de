"""Runtime options shared by every role: one frozen dataclass, one field per option.

A field is the whole of an option: its type and default, its command-line flag with its help, or why
no flag sets it, and its meaning in the docs (base/options/fields.py). ``paramserver`` builds its
flags from the fields (launch/cli/option_flags.py), and the option tables of docs/cli.md and
docs/configuration.md are generated from them (``python -m paramserver.launch.cli.docs --write
docs/cli.md docs/configuration.md``). A simple range is declared with its field too (``positive=True``,
``at_least=1``); base/options/checks.py checks those and the rules between options.
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
from paramserver.base.options.checks import range_problems
from paramserver.base.options.fields import CONSISTENCY, LIMITS, OPERATIONS, RUN, SECURITY, Flag, option
from paramserver.base.options.machine import DERIVED, TABLE_MEMORY_SHARE_WORDS, MachineMemory, for_machine

RECOVERIES = ("rollback", "partial")  # what a killed PS costs: the whole cluster rolls back, or its shard alone
_TUNING = "tuning, set in a cluster file's options or PARAMSERVER_OPTIONS when a deployment needs it"
_LAUNCHER = "the launcher sets it for the nodes it starts"
GRPC_MAX_MESSAGE = 2**31 - 1  # gRPC's message size limits are signed 32-bit


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
             doc="deadline in seconds of every call to a PS (positive)"),
        positive=True,
    )
    connect_timeout_s: float = option(
        120.0, no_flag=_TUNING, doc="seconds a worker waits at start for every PS to answer (positive)",
        positive=True)
    max_message_bytes: int = option(
        1 << 30,
        Flag("--max-message-bytes", LIMITS,
             "largest message sent or received (default {default}); a longer request or reply travels in several",
             "B", doc="largest single message sent or received, gRPC or tensor stream (TCP or shared memory): a "
             "longer request or reply travels in parts of at most this, put back together on the other side (as "
             "TensorFlow's TF_GRPC_MAX_BUFFER_SIZE; [protocol.md](protocol.md#tensor-stream)); a stream message "
             "declaring more is refused (RESOURCE_EXHAUSTED) before any memory is taken for it; 1024 to 2^31 - 1 "
             "([security.md](security.md#limits-and-bad-input))"),
        between=(1024, GRPC_MAX_MESSAGE),
    )
    max_payload_bytes: int = option(
        16 << 30,
        Flag("--max-payload-bytes", LIMITS,
             "largest request or reply put back together from its messages (default {default})", "B",
             doc="largest request or reply put back together from its parts: a PS refuses parts adding up to more "
             "(RESOURCE_EXHAUSTED) before it reads the one that passes it, and a worker refuses "
             "such a request before sending it; at least `max_message_bytes`"),
    )
    split_bytes: int = option(
        256 * 1024, no_flag=_TUNING, doc="variables of at least this many bytes are split along axis 0 across the "
        "PS ([configuration.md](configuration.md#placement)); at least 1", at_least=1)
    ps_threads: int = option(8, no_flag=_TUNING, doc="gRPC request threads of a PS (at least 1)",
        at_least=1)
    stream_port: int = option(
        0, no_flag="a free port, announced in Hello; `paramserver k8s` gives the gRPC port + 1",
        doc="TCP port of a PS's tensor stream; 0 picks a free port, announced in Hello; `paramserver k8s` gives "
        "each PS its gRPC port + 1 ([configuration.md](configuration.md#ports))",
        between=(0, 65535), says="a port number from 0 to 65535")
    use_stream: bool = option(
        True, no_flag=f"for tests and measurements of the transports; {_TUNING}",
        doc="true: pushes and pulls travel on the tensor stream; false: on gRPC")
    shared_memory: bool = option(
        True, no_flag=f"for tests and measurements of the transports; {_TUNING}",
        doc="true: a worker on the same host as a PS passes tensors to it through shared memory")
    torch_threads: int = option(
        0,
        Flag("--torch-threads", RUN,
             "torch intra-op threads per worker (default: the cores idle at the start / workers, at least 1)",
             "T", shown="the cores idle at the start / M, at least 1 (a PS works mostly while its workers wait; "
             "cores other processes keep busy are not counted)",
             doc="torch intra-op threads per worker; 0 keeps torch's default, except under `run` and `demo`, which "
             "then choose as their default says; every node `run` starts also gets `OMP_WAIT_POLICY=PASSIVE` unless "
             "the environment sets a wait policy "
             "([performance.md](performance.md#torch-threads-of-a-worker-and-shared-cores))"),
        at_least=0, says="0 (torch's default) or more",
    )
    progress_fd: int = option(
        -1, no_flag=_LAUNCHER, doc="file descriptor a worker writes its progress lines to; -1: none (`paramserver "
        "run` sets it; [protocol.md](protocol.md#progress-channel-worker---paramserver-run))",
        at_least=-1, says="-1 (none) or a file descriptor")
    mode: str = option(
        "async",
        Flag("--mode", CONSISTENCY, "consistency: async (default), sync, or ssp:K (at most K steps ahead)", "MODE",
             doc="consistency: `async`, `sync` or `ssp:K` (at most K steps ahead; [consistency.md](consistency.md))"),
    )
    backup_workers: int = option(
        0,
        Flag("--backup-workers", CONSISTENCY, "sync: apply a step without the last B workers", "B",
             doc="`sync` only: each step is applied once all workers but this many pushed it (fewer than the "
             "workers)"),
        at_least=0, says="0 or more",
    )
    max_workers: int = option(
        0,
        Flag("--max-workers", CONSISTENCY, "an elastic run: workers may join and leave, up to M in all", "M",
             doc="0: the workers of the cluster spec, fixed for the run. M > 0: an elastic run of up to M workers "
             "(slots 0..M-1; worker 0, the chief, stays for the whole run): workers join and leave while it "
             "trains, and the coordinator hands out the data ([elastic.md](elastic.md)); refuses "
             "`backup_workers` and dense_sync `allreduce`"),
        at_least=0, says="0 or more",
    )
    mode_schedule: str = option(
        "",
        Flag("--mode-schedule", CONSISTENCY, "switch modes at the chief's steps, e.g. 'sync@500'", "S",
             doc="`MODE@STEP,...`: switch modes when the workers reach those steps, e.g. `sync@500` or "
             "`ssp:2@100,sync@900` (increasing steps; [consistency.md](consistency.md#switching-while-training-runs))"),
    )
    max_table_ids: int = option(
        1 << 20, no_flag=_TUNING, doc="most ids one embedding lookup or sparse push may carry; a PS refuses more "
        "(at least 1)", at_least=1)
    heartbeat_s: float = option(
        1.0, no_flag=_TUNING, doc="seconds between a worker's heartbeats to the coordinator (positive)",
        positive=True)
    heartbeat_timeout_s: float = option(
        30.0,
        Flag("--heartbeat-timeout", CONSISTENCY,
             "seconds of silence after which a worker counts as dead (default {default:.0f}); a restart must "
             "rejoin within it", "S",
             doc="seconds of silence after which a worker counts as dead: waits that need it fail at once, naming "
             "it, and a restarted worker must join again within it (more than twice `heartbeat_s`)"),
    )
    checkpoint_dir: str = option(
        "",
        Flag("--checkpoint-dir", CONSISTENCY, "write checkpoints here (a path or fsspec URL, e.g. s3://b/run)", "D",
             doc="where checkpoints go: a path, NFS, or an fsspec URL such as `s3://bucket/run` (S3 access from the "
             "environment: [checkpoints.md](checkpoints.md#object-storage-s3)); empty: none; set, a clean end "
             "writes a final checkpoint even with no period"),
    )
    checkpoint_every: int = option(
        0,
        Flag("--checkpoint-every", CONSISTENCY, "steps between checkpoints (each worker's count)", "N",
             shown="0 (none)", doc="steps of the chief's count between checkpoints; 0: none (every worker stops at "
             "the same checkpoint, wherever it is; [checkpoints.md](checkpoints.md#when-it-is-taken-and-why-it-is-"
             "consistent))"),
        at_least=0, says="0 (none) or more",
    )
    checkpoint_every_seconds: float = option(
        0.0,
        Flag("--checkpoint-every-seconds", CONSISTENCY, "seconds between checkpoints, by the chief's clock", "S",
             shown="0 (none)", doc="seconds between checkpoints, by the chief's clock; 0: none"),
        at_least=0, says="0 (none) or more",
    )
    checkpoint_keep: int = option(
        3,
        Flag("--keep", CONSISTENCY, "complete checkpoints kept (default {default})", "K",
             doc="complete checkpoints kept (with the base and deltas they need); older ones are deleted (at least "
             "1; [checkpoints.md](checkpoints.md#retention))"),
        at_least=1,
    )
    checkpoint_base_every: int = option(
        8,
        Flag("--checkpoint-base-every", CONSISTENCY,
             "a whole checkpoint every K, deltas of the changed rows between (default {default}; 1: every "
             "checkpoint whole)", "K",
             doc="a whole (base) checkpoint every K; between, deltas holding only the table rows changed since "
             "the previous checkpoint (and a new base sooner when the deltas pass half the base's bytes); 1: "
             "every checkpoint whole; tiered tables always write whole files (at least 1; "
             "[checkpoints.md](checkpoints.md#incremental-checkpoints-a-base-then-what-changed))"),
        at_least=1, says="at least 1 (1: every checkpoint whole)",
    )
    checkpoint_quantize: str = option(
        "none",
        Flag("--checkpoint-quantize", CONSISTENCY,
             "store embedding rows in checkpoints as bfloat16, or int8 with a float32 scale per row (default "
             "none: float32; optimizer state stays float32; docs/checkpoints.md)",
             doc="how checkpoints store embedding-table rows: `none` (float32), `bf16` (bfloat16, rounded to "
             "nearest even) or `int8` (with one float32 scale per row); optimizer state and dense variables stay "
             "float32; read back as float32 by resume, `checkpoint` and serving "
             "([checkpoints.md](checkpoints.md#quantized-rows))"),
        choices=("none", "bf16", "int8"),
    )
    resume: bool = option(
        False,
        Flag("--resume", CONSISTENCY,
             "start from the latest complete checkpoint in --checkpoint-dir (fresh if none)",
             doc="every node starts from the latest complete checkpoint in `checkpoint_dir` (a fresh start if "
             "there is none); a PS of a cluster started by `paramserver node` (TF_CONFIG, `--cluster` or a "
             "Slurm step) with a "
             "`checkpoint_dir` always does, so that its restart resumes by itself "
             "([recovery.md](recovery.md#when-a-pod-dies))"),
    )
    restore_non_finite: bool = option(
        False,
        Flag("--restore-non-finite", CONSISTENCY,
             "resume from a checkpoint holding NaN or infinite values (by default it counts as damaged)",
             doc="resume from a checkpoint holding NaN or infinite values (by default it counts as damaged and "
             "the one before is taken; [checkpoints.md](checkpoints.md#resuming))"),
    )
    recovery: str = option(
        "rollback",
        Flag("--recovery", CONSISTENCY,
             "a killed PS: roll the whole cluster back to the latest checkpoint (rollback, the default), or "
             "restore its shard alone from its newest checkpoint while the rest goes on (partial; async mode)",
             doc="what a PS killed by a signal costs, with a `checkpoint_dir`: `rollback` sends the whole cluster "
             "back to the latest checkpoint; `partial` restarts that PS alone, restoring its shard from its newest "
             "checkpoint, while the other shards keep their state and the workers their data positions (async "
             "mode; the closing line's `partial_recoveries` says the steps that shard lost; without a checkpoint "
             "yet, in another mode, or for the chief, the run rolls back and says why; "
             "[recovery.md](recovery.md#partial-recovery-restore-the-lost-shard-alone))"),
        choices=RECOVERIES,
    )
    # communication
    compression: str = option(
        "auto",
        Flag("--compression", LIMITS,
             f"gradient compression: auto (default: bf16 where a link to a PS limits the step), none, a codec "
             f"for all ({CODEC_WORDS}) or PATTERN=CODEC rules, comma-separated (docs/performance.md)", "C",
             doc=f"gradient compression: `auto` (the default: for PS on other hosts, links measured at the first "
             "step; bf16 pushes, and pulls as bfloat16, where they predict a step at least 5% faster; nothing on "
             "one host), `none`, "
             f"one codec for every gradient ({CODEC_WORDS}) or `PATTERN=CODEC` rules "
             "over parameter and table names, comma-separated, the first match wins; tables skip `topk` rules "
             "([performance.md](performance.md#gradient-compression))"),
    )
    pull_as: str = option(
        "",
        Flag("--pull-as", LIMITS, "pulled float32 values travel as bfloat16 or float16 (half the bytes back; "
             "default: as they are, or as compression auto chooses)", "DTYPE",
             doc="`bfloat16` or `float16`: the PS sends its float32 values to the workers at half width (it keeps "
             "float32 masters; the workers compute with the rounded values). Empty (the default): float32, unless "
             "`compression` `auto` chooses bfloat16 for a slow link "
             "([performance.md](performance.md#compression-auto))"),
        choices=("", "bfloat16", "float16"),
    )
    dense_sync: str = option(
        "ps",
        Flag("--dense-sync", LIMITS, "dense variables: pushed to the PS (default) or all-reduced among the workers",
             doc="dense variables: `ps` (pushed to and applied on the PS) or `allreduce` (averaged among the "
             "workers with torch.distributed, embeddings stay on the PS); `allreduce` refuses `backup_workers` and "
             "`checkpoint_every_seconds` ([performance.md](performance.md#hybrid-all-reduce-for-dense-ps-for-"
             "embeddings))"),
        choices=("ps", "allreduce"),
    )
    eval_timeout_s: float = option(
        0.0, no_flag="an evaluator's own; set in PARAMSERVER_OPTIONS or a cluster file",
        doc="an evaluator task ends after this many seconds without a new checkpoint; 0: only after the final "
        "checkpoint (0 or more; [evaluator.md](evaluator.md))",
        at_least=0, says="0 (wait for the final checkpoint) or more")
    # limits a PS enforces before it takes memory
    max_table_rows: int = option(
        DERIVED,
        Flag("--max-table-rows", LIMITS,
             "most rows of one table on one PS (default: --max-table-memory / 48 B, the smallest row)", "N",
             shown="0: `max_table_memory_bytes` / 48 B",
             doc="most rows one embedding table may hold on one PS: a registration's capacity and the rows "
             "lookups create; past it, RESOURCE_EXHAUSTED naming it; 0: the PS's `max_table_memory_bytes` over "
             "48 bytes (the smallest row), so that memory is the limit that binds "
             "([configuration.md](configuration.md#table-limits-derived-from-the-machine); "
             "[security.md](security.md#limits-and-bad-input))"),
        at_least=0, says="0 (derived from the machine's memory) or more",
    )
    max_table_memory_bytes: int = option(
        DERIVED,
        Flag("--max-table-memory", LIMITS,
             f"most bytes of all tables on one PS, e.g. 64GiB (default: {TABLE_MEMORY_SHARE_WORDS} of the memory "
             "the PS may use: its cgroup's limit, else the machine's)", "B",
             shown=f"0: {TABLE_MEMORY_SHARE_WORDS} of the PS's memory",
             doc="most bytes all tables of one PS may hold (values, optimizer state, use counters and hash index, "
             "at their capacity; a new dense group counts with them, a tiered table its memory tier), checked "
             f"before memory is taken; 0: {TABLE_MEMORY_SHARE_WORDS} of the memory the PS may use (its cgroup's "
             "memory limit when one is set, else the machine's physical memory), read once when it starts; the "
             "flag also takes `64GiB`, `512MiB` "
             "([configuration.md](configuration.md#table-limits-derived-from-the-machine))", byte_size=True),
        at_least=0, says="0 (derived from the machine's memory) or more",
    )
    max_tiered_table_rows: int = option(
        1 << 34,
        Flag("--max-tiered-table-rows", LIMITS,
             "with --table-memory-budget: most rows of one table on one PS, memory and disk (default {default})",
             "N", doc="with a `table_memory_budget`: most rows one table may hold on one PS, memory and disk, "
             "instead of `max_table_rows` (at least 1)"),
        at_least=1,
    )
    max_gradient_magnitude: float = option(
        1e15,
        Flag("--max-gradient-magnitude", LIMITS,
             "refuse a pushed gradient holding a value larger than this in magnitude, like NaN (default {default:g})",
             "X", doc="a pushed gradient (dense or rows) holding a value larger than this in magnitude is refused, "
             "like NaN (positive)"),
        positive=True,
    )
    # tables bigger than memory
    table_memory_budget: int = option(
        0,
        Flag("--table-memory-budget", LIMITS,
             "bytes of table rows one PS keeps in memory, e.g. 4GiB; the rest go to --spill-dir (default 0: all "
             "in memory; docs/scaling.md)", "B", shown="0 (off)",
             doc="tables bigger than memory: bytes of table rows each PS keeps in memory, the rest in `spill_dir` "
             "on local disk (each needs the other); 0: every row in memory, else 64 KiB to "
             "`max_table_memory_bytes`; the flag also takes `4GiB`, `512MiB`, `1.5GB` "
             "([scaling.md](scaling.md#tiered-tables))", byte_size=True),
    )
    spill_dir: str = option(
        "",
        Flag("--spill-dir", LIMITS,
             "local directory where a PS with --table-memory-budget keeps the rows beyond it (each PS in a "
             "subdirectory of its own, deleted when it stops)", "D",
             doc="local directory where a PS with a `table_memory_budget` keeps the rows beyond it, in a "
             "subdirectory of its own (`shard-<index>-<hex>`) deleted when it stops; stale ones a killed PS left "
             "are deleted at start"),
    )
    spill_full_grace_s: float = option(
        60.0,
        Flag("--spill-full-grace", LIMITS,
             "seconds a PS's spill disk may stay full before its shard counts as failed (default {default:.0f})",
             "S", doc="seconds a PS's `spill_dir` disk may stay full (the PS NOT_SERVING, refusing what needs a "
             "write to disk) before its shard counts as failed and is recovered from its checkpoint (positive; "
             "[scaling.md](scaling.md#when-the-spill-store-fails))"),
        positive=True,
    )
    idle_timeout_s: float = option(
        300.0,
        Flag("--idle-timeout", LIMITS,
             "seconds after which an idle tensor-stream connection is closed (default {default:.0f})", "S",
             doc="seconds after which a tensor-stream connection without a request (or with a request stalled "
             "half-way) is closed; the client reconnects on its next call (positive)"),
        positive=True,
    )
    max_connections: int = option(
        256,
        Flag("--max-connections", LIMITS, "tensor-stream connections per PS (default {default})", "N",
             doc="tensor-stream connections one PS serves at once, counting those that proved themselves (a "
             "token, or a first message); one more is answered RESOURCE_EXHAUSTED and closed (at least 1)"),
        at_least=1,
    )
    # a node started by srun (launch/slurm/environment.py)
    slurm_ps: int = option(
        1,
        Flag("--slurm-ps", LIMITS, "under srun: the first N ranks of the job step are PS (default {default})", "N",
             doc="`paramserver node` under `srun` (no TF_CONFIG): the first N ranks of the job step are PS, the "
             "next the chief, the rest workers; a heterogeneous job's component 0 is the PS instead "
             "([configuration.md](configuration.md#slurm-the-nodes-role-from-the-job); at least 1)"),
        at_least=1,
    )
    slurm_port: int = option(
        0,
        Flag("--slurm-port", LIMITS,
             "under srun: each task's port is P + 2 x its SLURM_LOCALID (default 0: derived from the job id)",
             "P", shown="0: 20000 + (SLURM_JOB_ID % 2000) x 20",
             doc="`paramserver node` under `srun`: the base port of the job step; each task listens on it + 2 x its "
             "number among the tasks at its node's address (its SLURM_LOCALID), a PS's tensor stream on the next "
             "port; 0: 20000 + (SLURM_JOB_ID % 2000) x 20 "
             "([configuration.md](configuration.md#slurm-the-nodes-role-from-the-job))"),
        between=(0, 65534), says="0 (derived from the job id) or a port number up to 65534",
    )
    # operations
    metrics_port: int = option(
        -1,
        Flag("--metrics-port", OPERATIONS, "serve Prometheus metrics on this port (0: a free one)", "P",
             shown="none", doc="every node serves Prometheus metrics on this port; -1: none, 0: a free one, logged "
             "([operations.md](operations.md#metrics-prometheus)); `run` takes `0` only: its nodes share this "
             "host, each gets a free port of its own"),
        between=(-1, 65535), says="-1 (none), 0 (a free port) or a port number",
    )
    metrics_bind: str = option(
        "127.0.0.1",
        Flag("--metrics-bind", OPERATIONS,
             "host the metrics endpoint listens on (default {default}; 0.0.0.0: every interface)", "HOST",
             doc="the host the metrics endpoints listen on: an IP address or host name, `0.0.0.0` / `::` for every "
             "interface; `paramserver k8s` sets `0.0.0.0` with a metrics port"),
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
             doc="the chief writes TensorBoard event files here; empty: none "
             "([operations.md](operations.md#tensorboard))"),
    )
    summary_every: int = option(
        100,
        Flag("--summary-every", OPERATIONS, "steps between TensorBoard summaries (default {default})", "N",
             doc="steps of the chief between TensorBoard summaries (at least 1)"),
        at_least=1,
    )
    audit_log: str = option(
        "",
        Flag("--audit-log", OPERATIONS, "append the audit trail (JSON lines) to this file (PS, coordinator)", "FILE",
             shown="the node's log",
             doc="PS and coordinator append their audit trail (JSON lines) to this file; empty: to the logger "
             "`paramserver.audit` ([security.md](security.md#audit-log))"),
    )
    stop_ps_at_end: bool = option(
        False, no_flag="`paramserver k8s` sets it, so that every Job completes",
        doc="the chief ends every PS (a Shutdown with `end`: each drains and exits 0) once the run completed and "
        "every worker is done; `paramserver k8s` sets it, so that the PS Jobs complete with the run "
        "([deploy.md](deploy.md#cleanup))")
    drain_grace_s: float = option(
        10.0,
        Flag("--drain-grace", OPERATIONS,
             "SIGTERM: seconds for calls in flight to finish (default {default:.0f})", "S",
             doc="SIGTERM: seconds a PS gives calls in flight before it stops, after its health went NOT_SERVING "
             "(positive; [operations.md](operations.md#graceful-shutdown-sigterm))"),
        positive=True,
    )
    # (within Kubernetes' terminationGracePeriodSeconds, 30 by default)
    preempt_grace_s: float = option(
        20.0,
        Flag("--preempt-grace", OPERATIONS,
             "with --checkpoint-dir, SIGTERM or a first Ctrl-C writes a checkpoint at the next step, then stops: "
             "seconds it may take (default {default:.0f})", "S",
             doc="with a `checkpoint_dir`: SIGTERM or a first Ctrl-C writes a checkpoint at the workers' next "
             "step, then stops; seconds that may take before a worker exits without it (positive); a PS of a run "
             "that ends its PS (`stop_ps_at_end`) serves on that long after its first SIGTERM, for that checkpoint"),
        positive=True,
    )
    # security
    tls_cert: str = option(
        "",
        Flag("--tls-cert", SECURITY, "this node's PEM certificate (TLS on every channel)", "F",
             doc="this node's PEM certificate: TLS on every channel, gRPC and the tensor stream, with `tls_key`; "
             "`run` gives it to every node (`--certs` gives each its own; "
             "[security.md](security.md#tls-and-mutual-tls))"),
    )
    tls_key: str = option(
        "",
        Flag("--tls-key", SECURITY, "this node's PEM private key", "F",
             doc="this node's PEM private key, with `tls_cert`"),
    )
    tls_ca: str = option(
        "",
        Flag("--tls-ca", SECURITY, "PEM CA bundle: both ends verify each other (mutual TLS)", "F",
             doc="PEM CA bundle: both ends verify each other (mutual TLS; needs `tls_cert` and `tls_key`)"),
    )
    auth_tokens: str = option(
        "",
        Flag("--auth-tokens", SECURITY, "JSON file of accepted tokens and their roles (servers)", "FILE",
             doc="a PS / the coordinator accepts only calls with a known token of this JSON store, in its role; "
             "empty: no checks; `run --tokens` sets it ([security.md](security.md#tokens-roles-and-audit))"),
    )
    token_file: str = option(
        "",
        Flag("--token-file", SECURITY, "file holding the token this node presents", "FILE",
             doc="the file holding the token this node presents on every call; `run --tokens` sets it per node "
             "([security.md](security.md#token-files))"),
    )
    run_secret_file: str = option(
        "", no_flag=_LAUNCHER,
        doc="the file holding the secret of the `paramserver run` that started this node, read once at start; "
        "the node proves with it that it belongs to that run ([security.md](security.md#run-files))")
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
        return ConsistencySpec.parse(self.mode, num_workers, self.backup_workers, self.max_workers > 0)

    def for_machine(self, memory: MachineMemory | None = None) -> Options:
        """These options with `max_table_rows` and `max_table_memory_bytes` left at 0 derived from
        the memory this process may use (`memory`, read now when None; base/options/machine.py).
        A PS calls it once, when it starts; raises ConfigError when the result does not hold
        together (a table_memory_budget over the derived max_table_memory_bytes)."""
        return for_machine(self, memory)

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
