"""What each `paramserver` command does with its parsed command line (main.py picks the command)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from paramserver.base.config import ClusterSpec, Options, config_from_environ, load_cluster_file, options_from_environ
from paramserver.base.errors import ConfigError, ParamServerError
from paramserver.launch.cli.option_flags import given_options

if TYPE_CHECKING:
    from paramserver.security.auth import Credentials
    from paramserver.security.run_secret import RunSecret


def run_local(args: argparse.Namespace, script: str, script_args: list[str]) -> int:
    """`run` and `demo`: a whole cluster on this machine, then one closing JSON line."""
    from paramserver.launch.local.supervisor import LocalCluster, default_torch_threads

    if getattr(args, "engine", "local") == "ray":
        return run_ray(args, script, script_args)
    if args.ps < 1 or args.workers < 1:
        raise ConfigError(f"--ps and --workers must be at least 1, got {args.ps} and {args.workers}")
    given = given_options(args)
    threads = given.pop("torch_threads", 0) or default_torch_threads(args.workers)  # 0 here: as the cores allow
    options = Options(torch_threads=threads, **given)
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


def run_ray(args: argparse.Namespace, script: str, script_args: list[str]) -> int:
    """`run --engine ray`: every node a Ray actor (launch/ray); the closing JSON line as `run`'s."""
    from paramserver.launch.ray import run

    if args.ps < 1 or args.workers < 1:
        raise ConfigError(f"--ps and --workers must be at least 1, got {args.ps} and {args.workers}")
    local_only = [
        flag
        for flag, given in (("--certs", args.certs), ("--tokens", args.tokens), ("--evaluator", args.evaluator))
        if given
    ]
    if local_only:
        raise ConfigError(f"--engine ray does not take {', '.join(local_only)} (the local launcher's)")
    given = given_options(args)
    options = Options(**{"torch_threads": 1, **given})  # each worker asks Ray for 1 CPU
    return run(
        script,
        script_args,
        args.ps,
        args.workers,
        options,
        args.address,
        progress_every=args.progress_every,
        log_level=args.log_level,
        max_restarts=args.max_restarts,
    )


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


def k8s(args: argparse.Namespace) -> int:
    from paramserver.launch.kubernetes.manifests import Deployment, render

    deployment = Deployment(
        name=args.name,
        image=args.image,
        script=args.script,
        args=tuple(strip_dashes(args.args)),
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
        options=given_options(args),
    )
    text = render(deployment)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def slurm(args: argparse.Namespace) -> int:
    from paramserver.launch.slurm.sbatch import BatchJob, render

    job = BatchJob(
        script=args.script,
        args=tuple(strip_dashes(args.args)),
        ps=args.ps,
        workers=args.workers,
        het=args.het,
        nodes=args.nodes,
        gpus_per_worker=args.gpus_per_worker,
        ps_mem=args.ps_mem,
        time=args.time,
        grace=args.grace,
        partition=args.partition,
        name=args.name,
        python=args.python,
        options=given_options(args),  # --slurm-port among them
    )
    text = render(job)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def health(args: argparse.Namespace) -> int:
    """One node's health. Without --tls-* flags, TLS as PARAMSERVER_OPTIONS says: in a node's container
    (a Kubernetes exec probe) the node's own certificate."""
    from paramserver.launch.status import tls_aware_check
    from paramserver.security.tls import tls_from_options

    access = status_access(args)
    tls = access.tls if args.tls_cert or args.tls_ca else tls_from_options(options_from_environ(os.environ))
    if args.address:
        status = tls_aware_check(args.address, args.timeout, args.service, tls)
        print(status, flush=True)
        return 0 if status == "SERVING" else 1
    cluster = target(None)[0]  # every node of the cluster (TF_CONFIG's, or the local run's), one line each
    addresses = (*cluster.ps, *cluster.chief, *cluster.worker)
    statuses = [tls_aware_check(address, args.timeout, args.service, tls) for address in addresses]
    for address, status in zip(addresses, statuses):
        print(f"{address} {status}", flush=True)
    return 0 if all(status == "SERVING" for status in statuses) else 1


def make_certs(args: argparse.Namespace) -> int:
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


def status_access(args: argparse.Namespace) -> Credentials:
    """How `status`, `shutdown` and `health` reach the nodes: the TLS material and token given as flags."""
    from paramserver.security.auth import Credentials

    return Credentials.from_options(
        Options(
            tls_cert=args.tls_cert or "",
            tls_key=args.tls_key or "",
            tls_ca=args.tls_ca or "",
            token_file=args.token_file or "",
        )
    )


def target(path: str | None) -> tuple[ClusterSpec, RunSecret | None]:
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


def demo_script() -> Path:
    script = Path(__file__).resolve().parents[4] / "examples" / "digits.py"
    if not script.is_file():
        raise ParamServerError(f"the demo needs the examples/ folder of a source checkout; not found: {script}")
    return script


def strip_dashes(args: list[str]) -> list[str]:
    return args[1:] if args[:1] == ["--"] else args


def scale(target: list[str]) -> int:
    """`paramserver scale [RUN] N`: ask the launcher of an elastic local run for N workers."""
    from paramserver.launch.local import elastic
    from paramserver.launch.local.run_files import local_run

    if len(target) > 2 or not target[-1].isdigit():
        raise ConfigError(f"scale takes [RUN] N, N the workers wanted; got {' '.join(target)!r}")
    run = local_run(choice=target[0] if len(target) == 2 else None)
    if not run.max_workers:
        raise ConfigError(f"run {run.name} is not elastic: start it with --max-workers M to scale it")
    wanted = int(target[-1])
    elastic.check_count(wanted, run.max_workers)
    elastic.write_wish(run.path, wanted)
    print(f"asked run {run.name} for {wanted} workers (of at most {run.max_workers}); its output says when they run")
    return 0
