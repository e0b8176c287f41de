"""One training case on the emulated network: PS hosts and worker hosts, each a `paramserver node` started
from one cluster file (docs/deploy.md, "Several hosts by hand") inside its host's namespace, on its CPUs.

Every node listens on port 7000 of its own address and the PS's tensor stream on 7001: each namespace has
its own ports. Nodes in different namespaces never share memory (a node's host_id names its namespace), so
every push and pull crosses the shaped links over TCP.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

PORT, STREAM_PORT = 7000, 7001
START_ALLOWANCE_S = 120  # importing torch and joining, on two busy shared cores


def write_cluster(path: Path, ps, workers, options: dict) -> None:
    cluster = {"ps": [f"{host.address}:{PORT}" for host in ps],
               "worker": [f"{host.address}:{PORT}" for host in workers]}
    path.write_text(json.dumps({"cluster": cluster, "options": options}))


def node_argv(cluster_file: Path, role: str, index: int, script: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "paramserver",
        "--log-level",
        "INFO",  # compression auto says its choice at INFO (auto_choice reads it)
        "node",
        "--cluster",
        str(cluster_file),
        "--role",
        role,
        "--index",
        str(index),
        *script,
    ]


def results(out: Path) -> list[dict]:
    """The JSON lines a worker script printed among its node's log lines."""
    return [json.loads(line) for line in out.read_text(errors="replace").splitlines() if line.startswith('{"worker"')]


def case_options(case: str) -> dict:
    """The node options of a case: a `--compression` value ("none", "auto", "bf16", ...), then `+pull` for
    values pulled as bfloat16 (option `pull_as`), `@grpc` for gRPC instead of the tensor stream, `@msg=N`
    for messages of at most N bytes (option `max_message_bytes`, as TF_GRPC_MAX_BUFFER_SIZE),
    `@allreduce` for the dense part all-reduced among the workers (option `dense_sync`)."""
    codec, *variants = case.split("@")
    options: dict = {"compression": codec.removesuffix("+pull")}
    if codec.endswith("+pull"):
        options["pull_as"] = "bfloat16"
    for variant in variants:
        if variant == "grpc":
            options["use_stream"] = False
        elif variant == "allreduce":
            options["dense_sync"] = "allreduce"
        elif variant.startswith("msg="):
            options["max_message_bytes"] = int(variant.removeprefix("msg="))
        else:
            raise ValueError(f"case {case!r}: unknown variant {variant!r} (grpc, msg=N, allreduce)")
    return options


def run_case(net, ps, workers, script: list[str], codec: str, seconds: float, folder: Path) -> dict:
    """Trains `script` on `workers` against one PS in each host of `ps` (hosts of `net`) and returns the
    workers' figures summed. `codec`: a case of `case_options`."""
    options = {"stream_port": STREAM_PORT, "torch_threads": 1, **case_options(codec)}
    cluster_file = folder / "cluster.json"
    write_cluster(cluster_file, ps, workers, options)
    # `paramserver node` hands a PS the options of its flags and environment, not its cluster file's.
    env = {**os.environ, "PARAMSERVER_OPTIONS": json.dumps(options)}
    servers = [net.start(host, node_argv(cluster_file, "ps", i, []), env, folder / f"ps{i}.out")
               for i, host in enumerate(ps)]
    outs = [folder / f"worker{i}.out" for i in range(len(workers))]
    started = [
        net.start(host, node_argv(cluster_file, "worker", i, script), env, out)
        for i, (host, out) in enumerate(zip(workers, outs))
    ]
    try:
        deadline = time.monotonic() + seconds + START_ALLOWANCE_S
        for proc, out in zip(started, outs):
            code = proc.wait(max(deadline - time.monotonic(), 1))
            if code != 0:
                raise RuntimeError(f"{out.name} exited {code}:\n{out.read_text()[-3000:]}")
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(
            f"the workers took over {seconds + START_ALLOWANCE_S} s:\n{outs[0].read_text()[-3000:]}"
        ) from error
    finally:
        for proc in [*started, *servers]:
            net.stop(proc)  # SIGTERM: a PS drains and exits
    per_worker = [record for out in outs for record in results(out)]
    if len(per_worker) != len(workers):
        raise RuntimeError(f"{len(per_worker)} of {len(workers)} workers printed figures")
    return {
        "examples_per_s": round(sum(r["examples_per_s"] for r in per_worker), 1),
        "per_worker_examples_per_s": [r["examples_per_s"] for r in per_worker],
        "pushed_bytes_per_step": round(sum(r["pushed_bytes_per_step"] for r in per_worker) / len(per_worker)),
        "auto_chose": [auto_choice(out) for out in outs] if codec.startswith("auto") else None,
    }


def auto_choice(out: Path) -> str | None:
    """What compression auto chose in a worker's output (its log line, client/link.py), or None."""
    for line in out.read_text(errors="replace").splitlines():
        if "compression auto:" in line and "→" in line:
            return line.rsplit("→", 1)[1].strip()
    return None
