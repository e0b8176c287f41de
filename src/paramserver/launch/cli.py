"""The `paramserver` command: run, node, k8s, status, health, checkpoint, certs, demo. See docs/cli.md."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from paramserver.base.byte_size import parse_byte_size
from paramserver.base.config import ClusterSpec, Options, config_from_environ, load_cluster_file, options_from_environ
from paramserver.base.errors import ConfigError, ParamServerError
from paramserver.launch.logs import configure_logging

if TYPE_CHECKING:
    from paramserver.security.run_secret import RunSecret

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paramserver", description="Parameter-server training for PyTorch.", allow_abbrev=False
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start a whole cluster on this machine and run SCRIPT on every worker")
    _add_cluster_flags(run)
    run.add_argument(
        "--evaluator",
        action="store_true",
        help="also run SCRIPT as an evaluator task that evaluates each new checkpoint (needs "
        "--checkpoint-dir; docs/evaluator.md)",
    )
    run.add_argument("script", help="training script, run on every worker")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")

    node = sub.add_parser("node", help="run one node from TF_CONFIG or --cluster/--role/--index")
    node.add_argument("--cluster", help="JSON file with the cluster spec ({'ps': [...], 'worker': [...]})")
    node.add_argument(
        "--role",
        choices=["ps", "worker", "chief", "evaluator"],
        help="this node's role (with --cluster or PARAMSERVER_CLUSTER; else TF_CONFIG's task)",
    )
    node.add_argument("--index", type=int, help="this node's index within its role (default 0)")
    node.add_argument("--bind", help="PS only: listen address HOST:PORT (default: from the cluster spec)")
    _add_node_flags(node)
    node.add_argument("script", nargs="?", help="training script (workers and chief)")
    node.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")

    ckpt = sub.add_parser("checkpoint", help="list, inspect or export the checkpoints in DIR")
    ckpt.add_argument("action", choices=["list", "inspect", "export"])
    ckpt.add_argument("dir", help="checkpoint directory (a path or fsspec URL)")
    ckpt.add_argument("name", nargs="?", help="checkpoint name, e.g. ckpt-000000020 (default: the latest complete)")
    ckpt.add_argument("--out", help="export: the .safetensors file to write (default: <name>.safetensors here)")
    ckpt.add_argument(
        "--since",
        metavar="CKPT",
        help="export: only what changed after checkpoint CKPT (the rows written since, the ids deleted "
        "since, the dense variables), to update a serving copy of CKPT in place (docs/checkpoints.md)",
    )

    certs = sub.add_parser("certs", help="make a CA and a TLS certificate per node in DIR (docs/security.md)")
    certs.add_argument("dir", help="directory to write ca.crt, ca.key, <node>.crt, <node>.key to")
    certs.add_argument("--nodes", required=True, help="comma-separated node names, e.g. ps-0,ps-1,chief-0,worker-0")
    certs.add_argument(
        "--hosts",
        default="",
        help="comma-separated host names / IPs every node certificate names "
        "(besides localhost, 127.0.0.1 and the node's name)",
    )
    certs.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    certs.add_argument(
        "--tokens",
        action="store_true",
        help="also write a token per node (<node>.token) and the servers' store (tokens.json), "
        "replacing any there (docs/security.md)",
    )

    status = sub.add_parser("status", help="print every node of a running cluster: health, step, pushes/s, memory")
    status.add_argument(
        "cluster",
        nargs="?",
        help="cluster JSON file, as `node --cluster` takes (default: TF_CONFIG, else the local run)",
    )
    status.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    status.add_argument(
        "--interval", type=float, default=1.0, help="seconds between the two samples of pushes/s (default 1)"
    )
    status.add_argument("--timeout", type=float, default=2.0, help="deadline of each call to a node (default 2)")
    _add_security_flags(status)

    stop = sub.add_parser("shutdown", help="drain and stop every PS of a running cluster (an admin call)")
    stop.add_argument(
        "cluster",
        nargs="?",
        help="cluster JSON file, as `node --cluster` takes (default: TF_CONFIG, else the local run)",
    )
    stop.add_argument("--reason", default="", help="why, for the PS's log and audit trail")
    stop.add_argument("--timeout", type=float, default=5.0, help="deadline of each call to a PS (default 5)")
    _add_security_flags(stop)

    health = sub.add_parser("health", help="one node's health (grpc.health.v1): exit 0 when SERVING")
    health.add_argument(
        "address", nargs="?", help="HOST:PORT of the node (default: every node of TF_CONFIG's cluster or the local run)"
    )
    health.add_argument("--service", default="", help="a named service, e.g. paramserver.Shard (default: the node)")
    health.add_argument("--timeout", type=float, default=5.0, help="deadline of the call (default 5)")
    _add_security_flags(health)

    _add_k8s_parser(sub)

    demo = sub.add_parser("demo", help="train the digits classifier on a local cluster and print one JSON line")
    _add_cluster_flags(demo, ps=2, workers=2)
    demo.add_argument("--epochs", type=int, default=20, help="training epochs (default 20)")
    for command in sub.choices.values():  # `--work 2` is no `--workers 2`: only whole flags
        command.allow_abbrev = False
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; a flag no command knows is refused with that command's usage (exit 2)."""
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _add_k8s_parser(sub) -> None:
    k8s = sub.add_parser("k8s", help="print the Kubernetes objects of a cluster running SCRIPT (docs/deploy.md)")
    k8s.add_argument("--ps", type=int, default=1, help="number of PS (default 1)")
    k8s.add_argument("--workers", type=int, default=1, help="number of workers, a chief apart (default 1)")
    k8s.add_argument("--image", required=True, help="container image holding paramserver and SCRIPT")
    k8s.add_argument("--tfjob", action="store_true", help="one Kubeflow TFJob instead of a Job per node")
    k8s.add_argument("--dynamic-workers", action="store_true", help="TFJob: enableDynamicWorker (sparse TF_CONFIG)")
    k8s.add_argument("--chief", action="store_true", help="a chief besides the workers (else worker 0 is the chief)")
    k8s.add_argument("--evaluator", action="store_true", help="an evaluator task running SCRIPT too")
    k8s.add_argument("--name", default="paramserver", help="prefix of every object's name (default paramserver)")
    k8s.add_argument("--namespace", default="default", help="namespace of every object (default default)")
    k8s.add_argument(
        "--port", type=int, default=2222, help="every node's gRPC port; a PS's stream takes the next (default 2222)"
    )
    k8s.add_argument("--storage-size", default="10Gi", help="size of the checkpoint volume (default 10Gi)")
    k8s.add_argument("--certs", help="a directory made by `paramserver certs`: a Secret, mutual TLS everywhere")
    k8s.add_argument("--tokens", help="a directory of node tokens and tokens.json: a Secret, tokens everywhere")
    k8s.add_argument("--cpu", default="1", help="CPU request of each node (default 1)")
    k8s.add_argument("--memory", default="4Gi", help="memory request and limit of each node (default 4Gi)")
    k8s.add_argument("--uid", type=int, default=10001, help="numeric user of every container (default 10001)")
    k8s.add_argument(
        "--gid", type=int, default=10001, help="numeric group of every container and its volumes (default 10001)"
    )
    k8s.add_argument(
        "--ttl-after-finished",
        type=int,
        default=86400,
        help="seconds a finished Job (or the TFJob) and its pods are kept; -1: until deleted (default 86400)",
    )
    k8s.add_argument("-o", "--output", help="write the YAML to this file (default: stdout)")
    _add_mode_flags(k8s)
    _add_limit_flags(k8s)
    _add_ops_flags(k8s)
    k8s.add_argument("script", help="training script, its path inside the image")
    k8s.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def _add_cluster_flags(parser: argparse.ArgumentParser, ps: int = 1, workers: int = 1) -> None:
    parser.add_argument("--ps", type=int, default=ps, help=f"number of PS processes (default {ps})")
    parser.add_argument("--workers", type=int, default=workers, help=f"number of worker processes (default {workers})")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch intra-op threads per worker (default: the cores idle at the start / workers, at least 1)",
    )
    parser.add_argument(
        "--rpc-timeout",
        type=float,
        default=Options.rpc_timeout_s,
        help=f"deadline in seconds of each call to a PS (default {Options.rpc_timeout_s})",
    )
    parser.add_argument(
        "--progress-every", type=float, default=2.0, help="seconds between progress lines; 0 turns them off (default 2)"
    )
    parser.add_argument(
        "--tokens",
        metavar="DIR",
        help="run with tokens and roles: each node presents its own token from DIR, the PS and the "
        "coordinator check them (written there first when DIR has no tokens.json)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="recoveries from nodes killed by a signal, at most this many (default 3): a worker other than the "
        "chief restarts alone; a PS or the chief rolls the cluster back to its latest checkpoint (needs "
        "--checkpoint-dir)",
    )
    parser.add_argument(
        "--certs",
        help="mutual TLS: node ps-<i> / worker-<i> uses DIR/<node>.crt and .key, "
        "DIR/ca.crt (a directory made by `paramserver certs`)",
    )
    _add_node_flags(parser)


def _add_node_flags(parser: argparse.ArgumentParser) -> None:
    """Flags of every node: consistency, checkpoints, limits, operations, security."""
    _add_mode_flags(parser)
    _add_limit_flags(parser)
    _add_ops_flags(parser)
    _add_security_flags(parser)


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits (docs/security.md)")
    group.add_argument(
        "--max-table-rows", type=int, help=f"most rows of one table on one PS (default {Options.max_table_rows})"
    )
    group.add_argument(
        "--max-table-memory",
        type=_byte_size,
        help=f"most bytes of all tables on one PS, e.g. 16GiB (default {Options.max_table_memory_bytes})",
    )
    group.add_argument(
        "--table-memory-budget",
        type=_byte_size,
        help="bytes of table rows one PS keeps in memory, e.g. 4GiB; the rest go to --spill-dir "
        "(default 0: all in memory; docs/scaling.md)",
    )
    group.add_argument(
        "--spill-dir",
        help="local directory where a PS with --table-memory-budget keeps the rows beyond it "
        "(each PS in a subdirectory of its own, deleted when it stops)",
    )
    group.add_argument(
        "--max-tiered-table-rows",
        type=int,
        help=f"with --table-memory-budget: most rows of one table on one PS, memory and disk "
        f"(default {Options.max_tiered_table_rows})",
    )
    group.add_argument(
        "--max-gradient-magnitude",
        type=float,
        help=f"refuse a pushed gradient holding a value larger than this in magnitude, like NaN "
        f"(default {Options.max_gradient_magnitude:g})",
    )
    group.add_argument(
        "--max-message-bytes",
        type=int,
        help=f"largest message sent or received "
        f"(default {Options.max_message_bytes}); a longer "
        f"request or reply travels in several",
    )
    group.add_argument(
        "--max-payload-bytes",
        type=int,
        help=f"largest request or reply put back together from its messages (default {Options.max_payload_bytes})",
    )
    group.add_argument(
        "--compression",
        help="gradient compression: a codec for all (fp16, bf16, int8, topk:R) "
        "or PATTERN=CODEC rules, comma-separated (docs/performance.md)",
    )
    group.add_argument(
        "--dense-sync",
        choices=["ps", "allreduce"],
        help="dense variables: pushed to the PS (default) or all-reduced among the workers",
    )
    group.add_argument(
        "--idle-timeout",
        type=float,
        help=f"seconds after which an idle tensor-stream connection is closed (default {Options.idle_timeout_s:.0f})",
    )
    group.add_argument(
        "--max-connections", type=int, help=f"tensor-stream connections per PS (default {Options.max_connections})"
    )


def _add_ops_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("operations (docs/operations.md)")
    group.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (0: a free one)")
    group.add_argument(
        "--metrics-bind",
        help=f"host the metrics endpoint listens on (default {Options.metrics_bind}; 0.0.0.0: every interface)",
    )
    group.add_argument("--log-format", choices=["text", "json"], help="log lines: text (default) or json")
    group.add_argument("--logdir", help="the chief writes TensorBoard summaries here")
    group.add_argument(
        "--summary-every", type=int, help=f"steps between TensorBoard summaries (default {Options.summary_every})"
    )
    group.add_argument("--audit-log", help="append the audit trail (JSON lines) to this file (PS, coordinator)")
    group.add_argument(
        "--drain-grace",
        type=float,
        help=f"SIGTERM: seconds for calls in flight to finish (default {Options.drain_grace_s:.0f})",
    )
    group.add_argument(
        "--preempt-grace",
        type=float,
        help=f"with --checkpoint-dir, SIGTERM or a first Ctrl-C writes a checkpoint at the next step, then stops: "
        f"seconds it may take (default {Options.preempt_grace_s:.0f})",
    )


def _add_security_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (docs/security.md)")
    group.add_argument("--tls-cert", help="this node's PEM certificate (TLS on every channel)")
    group.add_argument("--tls-key", help="this node's PEM private key")
    group.add_argument("--tls-ca", help="PEM CA bundle: both ends verify each other (mutual TLS)")
    group.add_argument("--auth-tokens", help="JSON file of accepted tokens and their roles (servers)")
    group.add_argument("--token-file", help="file holding the token this node presents")


def _add_mode_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", help="consistency: async (default), sync, or ssp:K (at most K steps ahead)")
    parser.add_argument("--backup-workers", type=int, help="sync: apply a step without the last B workers")
    parser.add_argument("--mode-schedule", help="switch modes at the chief's steps, e.g. 'sync@500'")
    parser.add_argument("--checkpoint-dir", help="write checkpoints here (a path or fsspec URL, e.g. s3://b/run)")
    parser.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (each worker's count)")
    parser.add_argument(
        "--checkpoint-every-seconds", type=float, help="seconds between checkpoints, by the chief's clock"
    )
    parser.add_argument("--keep", type=int, help=f"complete checkpoints kept (default {Options.checkpoint_keep})")
    parser.add_argument(
        "--checkpoint-base-every",
        type=int,
        help=f"a whole checkpoint every K, deltas of the changed rows between (default "
        f"{Options.checkpoint_base_every}; 1: every checkpoint whole)",
    )
    parser.add_argument(
        "--checkpoint-quantize",
        choices=["none", "bf16", "int8"],
        help="store embedding rows in checkpoints as bfloat16, or int8 with a float32 scale per row (default "
        "none: float32; optimizer state stays float32; docs/checkpoints.md)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="start from the latest complete checkpoint in --checkpoint-dir (fresh if none)",
    )
    parser.add_argument(
        "--restore-non-finite",
        action="store_true",
        default=None,
        help="resume from a checkpoint holding NaN or infinite values (by default it counts as damaged)",
    )
    parser.add_argument(
        "--recovery",
        choices=["rollback", "partial"],
        help="a killed PS: roll the whole cluster back to the latest checkpoint (rollback, the default), or "
        "restore its shard alone from its newest checkpoint while the rest goes on (partial; async mode)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        help=f"seconds of silence after which a worker counts as dead (default "
        f"{Options.heartbeat_timeout_s:.0f}); a restart must rejoin within it",
    )


# flag (argparse dest) -> option, for the flags that set an option as they are
_FLAG_OPTIONS = {
    "mode": "mode",
    "backup_workers": "backup_workers",
    "mode_schedule": "mode_schedule",
    "checkpoint_dir": "checkpoint_dir",
    "checkpoint_every": "checkpoint_every",
    "checkpoint_every_seconds": "checkpoint_every_seconds",
    "keep": "checkpoint_keep",
    "checkpoint_base_every": "checkpoint_base_every",
    "checkpoint_quantize": "checkpoint_quantize",
    "heartbeat_timeout": "heartbeat_timeout_s",
    "recovery": "recovery",
    "max_table_rows": "max_table_rows",
    "max_table_memory": "max_table_memory_bytes",
    "table_memory_budget": "table_memory_budget",
    "spill_dir": "spill_dir",
    "max_tiered_table_rows": "max_tiered_table_rows",
    "max_gradient_magnitude": "max_gradient_magnitude",
    "max_message_bytes": "max_message_bytes",
    "max_payload_bytes": "max_payload_bytes",
    "idle_timeout": "idle_timeout_s",
    "max_connections": "max_connections",
    "compression": "compression",
    "dense_sync": "dense_sync",
    "metrics_port": "metrics_port",
    "metrics_bind": "metrics_bind",
    "log_format": "log_format",
    "logdir": "logdir",
    "summary_every": "summary_every",
    "audit_log": "audit_log",
    "drain_grace": "drain_grace_s",
    "preempt_grace": "preempt_grace_s",
    "tls_cert": "tls_cert",
    "tls_key": "tls_key",
    "tls_ca": "tls_ca",
    "auth_tokens": "auth_tokens",
    "token_file": "token_file",
}


def mode_options(args: argparse.Namespace) -> dict:
    """The options given on the command line (unset ones left out)."""
    given = {option: getattr(args, flag, None) for flag, option in _FLAG_OPTIONS.items()}
    given["resume"] = True if args.resume else None
    given["restore_non_finite"] = True if getattr(args, "restore_non_finite", None) else None
    return {key: value for key, value in given.items() if value is not None}


def _run_local(args: argparse.Namespace, script: str, script_args: list[str]) -> int:
    from paramserver.launch.local.supervisor import LocalCluster, default_torch_threads

    if args.ps < 1 or args.workers < 1:
        raise ConfigError(f"--ps and --workers must be at least 1, got {args.ps} and {args.workers}")
    threads = args.torch_threads or default_torch_threads(args.workers)
    options = Options(rpc_timeout_s=args.rpc_timeout, torch_threads=threads, **mode_options(args))
    options.validate(args.workers)  # what needs the cluster's size too, before any process starts
    if options.metrics_port > 0:
        raise ConfigError("with `run` every node shares this host: --metrics-port 0 gives each a free port of its own")
    evaluator = getattr(args, "evaluator", False)  # `demo` has none
    if evaluator and not options.checkpoint_dir:
        raise ConfigError("--evaluator evaluates the run's checkpoints: give --checkpoint-dir too")
    certs = _cert_dir(args, options)
    if not Path(script).is_file():
        raise ConfigError(f"training script {script} does not exist")
    if args.tokens:
        from paramserver.security.tokens import STORE_FILE, local_nodes, write_tokens

        if not (Path(args.tokens) / STORE_FILE).exists():
            write_tokens(Path(args.tokens), local_nodes(args.ps, args.workers))
    cluster = LocalCluster(
        args.ps,
        args.workers,
        script,
        script_args,
        options,
        progress_every=args.progress_every,
        log_level=args.log_level,
        max_restarts=args.max_restarts,
        certs=certs,
        tokens=args.tokens,
        evaluator=evaluator,
    )
    try:
        return cluster.run()
    finally:  # the closing line, however the run ended: nothing interrupts it once the nodes are gone
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(json.dumps(cluster.summary()), flush=True)


def _cert_dir(args: argparse.Namespace, options: Options) -> Path | None:
    """`--certs DIR`, once it holds every node's files (and no --tls-* flag competes with it)."""
    if not args.certs:
        return None
    from paramserver.security.certs import check_cert_dir, ps_node_name, worker_node_name

    if options.tls_cert or options.tls_ca:
        raise ConfigError("--certs gives every node its own --tls-cert, --tls-key and --tls-ca: give one or the other")
    nodes = [ps_node_name(i) for i in range(args.ps)] + [worker_node_name(i) for i in range(args.workers)]
    check_cert_dir(Path(args.certs), nodes)
    return Path(args.certs)


def _k8s(args: argparse.Namespace) -> int:
    from paramserver.launch.kubernetes.manifests import Deployment, render

    deployment = Deployment(
        name=args.name,
        image=args.image,
        script=args.script,
        args=tuple(_strip_dashes(args.args)),
        ps=args.ps,
        workers=args.workers,
        chief=args.chief,
        evaluator=args.evaluator,
        namespace=args.namespace,
        port=args.port,
        tfjob=args.tfjob,
        dynamic_workers=args.dynamic_workers,
        storage_size=args.storage_size,
        certs=Path(args.certs) if args.certs else None,
        tokens=Path(args.tokens) if args.tokens else None,
        cpu=args.cpu,
        memory=args.memory,
        uid=args.uid,
        gid=args.gid,
        ttl_after_finished=args.ttl_after_finished,
        options=mode_options(args),
    )
    text = render(deployment)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _health(args: argparse.Namespace) -> int:
    """One node's health. Without --tls-* flags, TLS as PARAMSERVER_OPTIONS says: in a node's container
    (a Kubernetes exec probe) the node's own certificate."""
    from paramserver.launch.status import tls_aware_check
    from paramserver.security.tls import tls_from_options

    access = _status_access(args)
    tls = access.tls if args.tls_cert or args.tls_ca else tls_from_options(options_from_environ(os.environ))
    if args.address:
        status = tls_aware_check(args.address, args.timeout, args.service, tls)
        print(status, flush=True)
        return 0 if status == "SERVING" else 1
    cluster = _cluster_spec(None)  # every node of the cluster (TF_CONFIG's, or the local run's), one line each
    addresses = (*cluster.ps, *cluster.chief, *cluster.worker)
    statuses = [tls_aware_check(address, args.timeout, args.service, tls) for address in addresses]
    for address, status in zip(addresses, statuses):
        print(f"{address} {status}", flush=True)
    return 0 if all(status == "SERVING" for status in statuses) else 1


def _make_certs(args: argparse.Namespace) -> int:
    from paramserver.security.certs import write_certs

    nodes = _names(args.nodes)
    written = write_certs(Path(args.dir), nodes, _names(args.hosts), args.days)
    if args.tokens:
        from paramserver.security.tokens import STORE_FILE, write_tokens

        write_tokens(Path(args.dir), nodes)
        written += [Path(args.dir) / f"{node}.token" for node in nodes] + [Path(args.dir) / STORE_FILE]
    print(json.dumps({"dir": str(Path(args.dir).resolve()), "files": [p.name for p in written]}), flush=True)
    return 0


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _status_access(args: argparse.Namespace):
    """How `status` and `shutdown` reach the nodes: the TLS material and token given as flags."""
    from paramserver.security.auth import Credentials

    return Credentials.from_options(
        Options(
            tls_cert=args.tls_cert or "",
            tls_key=args.tls_key or "",
            tls_ca=args.tls_ca or "",
            token_file=args.token_file or "",
        )
    )


def _cluster_spec(path: str | None) -> ClusterSpec:
    """The cluster of a cluster file, else of TF_CONFIG, else of the `paramserver run` on this machine."""
    return _target(path)[0]


def _target(path: str | None) -> tuple[ClusterSpec, RunSecret | None]:
    """The cluster of a cluster file, else of TF_CONFIG, else of this user's `paramserver run` on this
    machine, whose files must show it is to be trusted (launch/local/run_files.py); with that run's secret,
    which its nodes must prove they hold before they are sent anything (None: a cluster the caller named)."""
    if path:
        return load_cluster_file(path, "ps", 0).cluster, None
    config = config_from_environ(os.environ, Options())
    if config is None:
        from paramserver.launch.local.run_files import local_run

        run = local_run()
        return run.cluster, run.secret
    return config.cluster, None


def _demo_script() -> Path:
    script = Path(__file__).resolve().parents[3] / "examples" / "digits.py"
    if not script.is_file():
        raise ParamServerError(f"the demo needs the examples/ folder of a source checkout; not found: {script}")
    return script


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    _configure_logging(args)
    # SIGTERM stops a launcher as cleanly as Ctrl-C does; SIGINT is set too, since a process started in
    # the background by a shell (or by a job that was) inherits SIGINT ignored, and `kill -INT` must still stop it.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        if args.command == "run":
            return _run_local(args, args.script, _strip_dashes(args.args))
        if args.command == "demo":
            return _run_local(args, str(_demo_script()), ["--epochs", str(args.epochs)])
        if args.command == "certs":
            return _make_certs(args)
        if args.command == "k8s":
            return _k8s(args)
        if args.command == "health":
            return _health(args)
        if args.command == "checkpoint":
            if args.since is not None:
                from paramserver.checkpoint.export.delta_export import run_delta_export

                return run_delta_export(args.action, args.dir, args.name, args.out, args.since)
            from paramserver.checkpoint.tools import run_tool

            return run_tool(args.action, args.dir, args.name, args.out)
        if args.command == "status":
            from paramserver.launch.status import run_status

            cluster, secret = _target(args.cluster)
            return run_status(cluster, args.json, args.interval, args.timeout, _status_access(args), secret)
        if args.command == "shutdown":
            from paramserver.launch.status import shutdown_cluster

            cluster, secret = _target(args.cluster)
            return shutdown_cluster(cluster, args.timeout, _status_access(args), args.reason, secret)
        from paramserver.launch.node_command import run_node

        script_args = _strip_dashes(args.args)
        return run_node(args.cluster, args.role, args.index, args.bind, args.script, script_args, mode_options(args))
    except ParamServerError as exc:
        print(f"paramserver: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


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


def _byte_size(text: str) -> int:
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _strip_dashes(args: list[str]) -> list[str]:
    return args[1:] if args[:1] == ["--"] else args


if __name__ == "__main__":
    sys.exit(main())
