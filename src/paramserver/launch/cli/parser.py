"""The command line of `paramserver`: each command's own flags, and the option flags it takes
(option_flags.py builds those from the `Options` fields)."""

from __future__ import annotations

import argparse

from paramserver.launch.cli.option_flags import add_option_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paramserver", description="Parameter-server training for PyTorch.", allow_abbrev=False
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="start a whole cluster on this machine and run SCRIPT on every worker")
    _add_cluster_flags(run, "run")
    run.add_argument(
        "--evaluator",
        action="store_true",
        help="also run SCRIPT as an evaluator task that evaluates each new checkpoint (needs "
        "--checkpoint-dir; docs/evaluator.md)",
    )
    run.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local: every node a process on this machine (default); ray: every node a Ray actor of the Ray "
        "cluster at --address (pip install 'paramserver[ray]'; docs/deploy.md)",
    )
    run.add_argument(
        "--address", help="--engine ray: the Ray cluster's HOST:PORT (default: RAY_ADDRESS, else this host's)"
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
    add_option_flags(node, "node")
    node.add_argument("script", nargs="?", help="training script (workers and chief)")
    node.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")

    _add_checkpoint_parser(sub)
    _add_certs_parser(sub)
    _add_cluster_call_parsers(sub)
    _add_k8s_parser(sub)
    _add_slurm_parser(sub)

    demo = sub.add_parser("demo", help="train the digits classifier on a local cluster and print one JSON line")
    _add_cluster_flags(demo, "demo", ps=2, workers=2)
    demo.add_argument("--epochs", type=int, default=20, help="training epochs (default 20)")
    for command in sub.choices.values():  # `--work 2` is no `--workers 2`: only whole flags
        command.allow_abbrev = False
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; a flag no command knows is refused with that command's usage (exit 2)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command_parsers(parser)[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's own parser, by the command's name."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _add_checkpoint_parser(sub) -> None:
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


def _add_certs_parser(sub) -> None:
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


def _add_cluster_call_parsers(sub) -> None:
    """status, shutdown and health: calls to a running cluster."""
    status = sub.add_parser("status", help="print every node of a running cluster: health, step, pushes/s, memory")
    status.add_argument(
        "cluster",
        nargs="?",
        metavar="CLUSTER|RUN",
        help="cluster JSON file, as `node --cluster` takes, or one of your local runs (its name run-PID-TAG, "
        "its pid, or its run file) (default: TF_CONFIG, else your local run; with several, they are listed)",
    )
    status.add_argument(
        "--run", help="one of your local runs, by its name run-PID-TAG, its launcher's pid or its run file"
    )
    status.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    status.add_argument(
        "--interval", type=float, default=1.0, help="seconds between the two samples of pushes/s (default 1)"
    )
    status.add_argument("--timeout", type=float, default=2.0, help="deadline of each call to a node (default 2)")
    add_option_flags(status, "status")

    stop = sub.add_parser("shutdown", help="drain and stop every PS of a running cluster (an admin call)")
    stop.add_argument(
        "cluster",
        nargs="?",
        help="cluster JSON file, as `node --cluster` takes (default: TF_CONFIG, else the local run)",
    )
    stop.add_argument("--reason", default="", help="why, for the PS's log and audit trail")
    stop.add_argument("--timeout", type=float, default=5.0, help="deadline of each call to a PS (default 5)")
    add_option_flags(stop, "shutdown")

    scale = sub.add_parser("scale", help="change how many workers an elastic local run trains with (docs/elastic.md)")
    scale.add_argument(
        "target",
        nargs="+",
        metavar="[RUN] N",
        help="the workers wanted, from 1 to the run's --max-workers; RUN (its name run-PID-TAG or its pid) when you "
        "have several runs",
    )

    health = sub.add_parser("health", help="one node's health (grpc.health.v1): exit 0 when SERVING")
    health.add_argument(
        "address", nargs="?", help="HOST:PORT of the node (default: every node of TF_CONFIG's cluster or the local run)"
    )
    health.add_argument("--service", default="", help="a named service, e.g. paramserver.Shard (default: the node)")
    health.add_argument("--timeout", type=float, default=5.0, help="deadline of the call (default 5)")
    add_option_flags(health, "health")


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
    add_option_flags(k8s, "k8s")
    k8s.add_argument("script", help="training script, its path inside the image")
    k8s.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def _add_slurm_parser(sub) -> None:
    slurm = sub.add_parser("slurm", help="print an sbatch script running SCRIPT on a Slurm cluster (docs/deploy.md)")
    slurm.add_argument("--ps", type=int, default=1, help="number of PS (default 1)")
    slurm.add_argument("--workers", type=int, default=1, help="number of workers, the chief among them (default 1)")
    slurm.add_argument(
        "--het",
        action="store_true",
        help="a heterogeneous job: the PS in component 0, the workers in component 1 (on nodes of their own)",
    )
    slurm.add_argument("--nodes", type=int, default=0, help="homogeneous job: nodes to spread the tasks over")
    slurm.add_argument("--gpus-per-worker", type=int, default=0, help="--het: GPUs of each worker, one per node")
    slurm.add_argument("--ps-mem", default="", help="--het: memory of the PS node (sbatch --mem), e.g. 8G")
    slurm.add_argument("--time", default="", help="the job's time limit, HH:MM:SS or D-HH:MM:SS")
    slurm.add_argument(
        "--grace",
        type=int,
        default=120,
        help="seconds before the time limit at which the workers write a checkpoint and the job is requeued "
        "(default 120)",
    )
    slurm.add_argument("--partition", default="", help="the partition (default: the cluster's)")
    slurm.add_argument("--name", default="paramserver", help="the job's name (default paramserver)")
    slurm.add_argument(
        "--python", default="python3", help="the Python with paramserver on every node (default python3)"
    )
    slurm.add_argument("-o", "--output", help="write the script to this file (default: stdout)")
    add_option_flags(slurm, "slurm")
    slurm.add_argument("script", help="training script, its path on every node")
    slurm.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def _add_cluster_flags(parser: argparse.ArgumentParser, command: str, ps: int = 1, workers: int = 1) -> None:
    """The launcher's own flags (run, demo), then every option flag."""
    parser.add_argument("--ps", type=int, default=ps, help=f"number of PS processes (default {ps})")
    parser.add_argument("--workers", type=int, default=workers, help=f"number of worker processes (default {workers})")
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
    add_option_flags(parser, command)
