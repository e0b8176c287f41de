"""`paramserver status CLUSTER`: one line per node of a running cluster; `paramserver shutdown
CLUSTER`: every PS drains and stops (docs/operations.md).

Asks every node's health service, every PS's Hello (counters, tables, memory) twice, `interval`
seconds apart, for its pushes per second, and the coordinator's Hello for the workers' steps and
states. Every call has a deadline and the nodes are asked at once: the command never hangs on a
node that does not answer; that node shows as UNREACHABLE, or TLS_REQUIRED when it serves TLS and
no --tls-* flag was given. Without CLUSTER: TF_CONFIG's cluster, else the local `paramserver run`'s
(launch/local/run_files.py).

A local run's nodes are asked to prove they belong to it first (`prove`: a challenge on the run's
secret, over the Prove RPC, which carries no token): a node that does not is asked nothing else, so
no token, Hello or Shutdown reaches a listener that took a node's address (UNPROVEN). With --tls-ca
the TLS handshake checks each node's certificate against that CA before any call as well.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from concurrent import futures
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from paramserver.base.config import ClusterSpec
from paramserver.base.errors import ParamServerError
from paramserver.checkpoint.store import is_checkpoint_name
from paramserver.coordinator.coordinator_service import SERVICE as COORDINATOR
from paramserver.security.auth import NO_CREDENTIALS, Credentials
from paramserver.security.run_secret import COORDINATOR_NODE, RunSecret, new_nonce, ps_node
from paramserver.security.tls import TlsMaterial, open_channel
from paramserver.transport.grpc_transport import SERVICE as SHARD
from paramserver.transport.health import UNREACHABLE, check
from paramserver.wire import codec
from paramserver.wire import messages as msg

TLS_REQUIRED = "TLS_REQUIRED"  # the node serves TLS: status and health need --tls-ca (and a certificate for mTLS)
UNPROVEN = "UNPROVEN"  # a local run's node that did not prove it belongs to the run: asked nothing else
_COLUMNS = (
    ("role", "ROLE"),
    ("index", "INDEX"),
    ("address", "ADDRESS"),
    ("health", "HEALTH"),
    ("step", "STEP/VERSION"),
    ("pushes_per_s", "PUSHES/S"),
    ("rows", "ROWS"),
    ("memory", "MEMORY"),
)


@dataclass
class NodeStatus:
    """One node as `status` saw it; None where the node did not say (or was not asked)."""

    role: str
    index: int
    address: str
    health: str = UNREACHABLE
    state: str | None = None  # a worker: joining, training, finished, exited, dead or absent (the coordinator's)
    step: int | None = None  # a worker: the run's step (`run_step`); a PS: its version (updates applied)
    pushes_per_s: float | None = None
    rows: int | None = None
    rss_bytes: int | None = None
    resumed_from: str | None = None  # a PS: the checkpoint it restored; a worker: the one the run resumed from
    events: list | None = None  # worker 0 of an elastic run: the joins and leaves, [seconds, worker, what]


def run_step(resumed_from: str | None, steps: int) -> int:
    """A worker's step in the run: the step of the checkpoint the run resumed from (its name says it,
    checkpoint/store.py) plus the `steps` the worker reported since (worker/recovery/lineage.py)."""
    return (int(resumed_from.rpartition("-")[2]) if resumed_from is not None else 0) + steps


def resumed_from(hellos: list[dict[str, Any] | None]) -> tuple[bool, str | None]:
    """(known, the checkpoint the run resumed from) given the PS's Hello replies (None: no answer):
    unknown when no PS answered; else the oldest checkpoint one restored, none if one restored none.
    A PS restored alone later (partial recovery) restored a newer one: the run's step did not jump."""
    answered = [hello for hello in hellos if hello is not None]
    if not answered:
        return False, None
    names = [hello.get("restored_from") for hello in answered]
    restored = [str(name) for name in names if is_checkpoint_name(name)]
    if len(restored) < len(names):
        return True, None
    return True, min(restored, key=lambda name: int(name.rpartition("-")[2]))


def tls_aware_check(address: str, timeout: float, service: str = "", tls: TlsMaterial | None = None) -> str:
    """transport.health.check, but a node that did not answer plaintext because it serves TLS is
    TLS_REQUIRED (give --tls-ca, and --tls-cert/--tls-key for mutual TLS), not UNREACHABLE."""
    status = check(address, timeout, service, tls)
    if status == UNREACHABLE and tls is None and speaks_tls(address, timeout):
        return TLS_REQUIRED
    return status


def speaks_tls(address: str, timeout: float) -> bool:
    """Whether the server at `address` answers a TLS handshake: it completes, or the server sends a
    TLS alert (mutual TLS refusing a client without a certificate). Nothing is verified: it only tells
    a TLS server from a dead one."""
    host, _, port = address.rpartition(":")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=host.strip("[]") or None):
                return True
    except ssl.SSLError as exc:
        return "ALERT" in (exc.reason or "").upper()
    except (OSError, ValueError):
        return False


def prove(address: str, service: str, node: str, secret: RunSecret, timeout: float, tls: TlsMaterial | None) -> bool:
    """Whether the node at `address` proves, within `timeout`, that it is node `node` of the run whose
    secret is `secret`: it answers a fresh nonce with the MAC only that run's node `node` can make.
    The call carries no token."""
    with open_channel(address, tls) as channel:
        return proves(channel, service, node, secret, timeout)


def proves(channel: grpc.Channel, service: str, node: str, secret: RunSecret, timeout: float) -> bool:
    """`prove` on an open channel (which the caller then uses for what it asks of a node that proved itself)."""
    nonce = new_nonce()
    try:
        reply = channel.unary_unary(f"/{service}/Prove")(
            codec.encode(msg.ProveRequest(nonce=nonce).to_meta()), timeout=timeout
        )
    except grpc.RpcError:
        return False
    try:
        proof = msg.ProveReply.from_meta(codec.decode(reply).meta).proof
    except (ParamServerError, ValueError):
        return False
    return secret.verify(node, nonce, proof)


def hello(address: str, service: str, timeout: float, access: Credentials = NO_CREDENTIALS) -> dict[str, Any] | None:
    """The meta of `service`'s Hello reply at `address` (with the process's memory), or None if it did
    not answer within `timeout`."""
    with open_channel(address, access.tls) as channel:
        try:
            reply = channel.unary_unary(f"/{service}/Hello")(
                codec.encode({"process": True}), timeout=timeout, metadata=access.metadata
            )
        except grpc.RpcError:
            return None
    return codec.decode(reply).meta


def cluster_status(
    cluster: ClusterSpec,
    interval: float = 1.0,
    timeout: float = 2.0,
    access: Credentials = NO_CREDENTIALS,
    secret: RunSecret | None = None,
) -> list[NodeStatus]:
    """Every node of `cluster`: PS first, then the chief and the workers. With the `secret` of a local
    run, a PS or the coordinator that does not prove it belongs to the run is UNPROVEN and asked nothing else."""
    nodes = [NodeStatus("ps", i, a) for i, a in enumerate(cluster.ps)]
    nodes += [NodeStatus("chief", i, a) for i, a in enumerate(cluster.chief)]
    nodes += [NodeStatus("worker", i, a) for i, a in enumerate(cluster.worker)]
    workers = [n for n in nodes if n.role != "ps"]  # in worker-number order: the chief is worker 0
    with futures.ThreadPoolExecutor(max_workers=min(32, 2 * len(nodes) + 1), thread_name_prefix="status") as pool:
        healths = [pool.submit(tls_aware_check, n.address, timeout, "", access.tls) for n in nodes]
        proven = _proven(pool, cluster, secret, timeout, access.tls)
        ps_proven, coordinator_proven = proven[:-1], proven[-1]
        view = pool.submit(hello, workers[0].address, COORDINATOR, timeout, access) if coordinator_proven else None
        first = _sample(pool, cluster.ps, ps_proven, timeout, access)
        time.sleep(interval)  # the sampling interval of pushes/s, nothing waits on it
        second = _sample(pool, cluster.ps, ps_proven, timeout, access)
        for node, health in zip(nodes, healths):
            node.health = health.result()
        for node, ok in zip([*nodes[: len(cluster.ps)], workers[0]], proven):
            node.health = node.health if ok else UNPROVEN
        _fill_ps(nodes[: len(cluster.ps)], first, second)
        resumed = resumed_from([after or before for (before, _), (after, _) in zip(first, second)])
        _fill_workers(workers, view.result() if view is not None else None, resumed)
    return nodes


def _proven(
    pool: futures.ThreadPoolExecutor,
    cluster: ClusterSpec,
    secret: RunSecret | None,
    timeout: float,
    tls: TlsMaterial | None,
) -> list[bool]:
    """Whether each PS, and last the coordinator (worker 0), proved it belongs to the run of `secret`
    (all of them, without a secret: a cluster the caller named)."""
    if secret is None:
        return [True] * (len(cluster.ps) + 1)
    nodes = [(address, SHARD, ps_node(i)) for i, address in enumerate(cluster.ps)]
    nodes.append(((*cluster.chief, *cluster.worker)[0], COORDINATOR, COORDINATOR_NODE))
    calls = [pool.submit(prove, address, service, node, secret, timeout, tls) for address, service, node in nodes]
    return [call.result() for call in calls]


def _sample(
    pool: futures.ThreadPoolExecutor,
    addresses: tuple[str, ...],
    proven: list[bool],
    timeout: float,
    access: Credentials,
) -> list:
    calls = [
        pool.submit(hello, address, SHARD, timeout, access) if ok else None for address, ok in zip(addresses, proven)
    ]
    return [(call.result() if call is not None else None, time.monotonic()) for call in calls]


def _fill_ps(nodes: list[NodeStatus], first: list, second: list) -> None:
    for node, (before, t0), (after, t1) in zip(nodes, first, second):
        latest = after or before
        if latest is None:
            continue
        node.step = latest.get("version")
        node.rows = sum(table.get("rows", 0) for table in (latest.get("tables") or {}).values())
        node.rss_bytes = latest.get("rss_bytes")
        node.resumed_from = latest.get("restored_from")
        if before is not None and after is not None and t1 > t0:
            node.pushes_per_s = round((after["pushes"] - before["pushes"]) / (t1 - t0), 1)


def _fill_workers(workers: list[NodeStatus], view: dict | None, resumed: tuple[bool, str | None]) -> None:
    """Each worker's state and run step from the coordinator's view; the steps it holds count from
    each worker's start, so without a PS's answer (`resumed` unknown) a worker's step is unknown."""
    if view is None:
        return
    known, checkpoint = resumed
    workers[0].events = view.get("events")
    for number, node in enumerate(workers):
        node.state = (view.get("states") or {}).get(str(number))
        steps = (view.get("steps") or {}).get(str(number))
        node.resumed_from = checkpoint
        node.step = run_step(checkpoint, steps) if known and isinstance(steps, int) else None


def table(nodes: list[NodeStatus]) -> str:
    """The nodes as aligned text columns, with a header line."""
    rows = [[title for _, title in _COLUMNS]] + [[_cell(node, key) for key, _ in _COLUMNS] for node in nodes]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def _cell(node: NodeStatus, key: str) -> str:
    if key == "memory":
        return "-" if node.rss_bytes is None else f"{node.rss_bytes / 2**20:.0f} MiB"
    if key == "health" and node.state is not None:
        return f"{node.health} ({node.state})"
    value = getattr(node, key)
    return "-" if value is None else str(value)


def run_status(
    cluster: ClusterSpec,
    as_json: bool,
    interval: float,
    timeout: float,
    access: Credentials = NO_CREDENTIALS,
    secret: RunSecret | None = None,
) -> int:
    """Print the cluster's status; exit code 0 when every node is SERVING, else 1."""
    nodes = cluster_status(cluster, interval, timeout, access, secret)
    print(json.dumps([asdict(n) for n in nodes]) if as_json else table(nodes) + _membership(nodes), flush=True)
    # an elastic run's slots no worker holds now serve nothing, and are not down
    return 0 if all(n.health == "SERVING" or n.state in ("absent", "exited") for n in nodes) else 1


def _membership(nodes: list[NodeStatus], shown: int = 10) -> str:
    """An elastic run's latest joins and leaves, one line each (the coordinator's, seconds since it started)."""
    events = next((n.events for n in nodes if n.events), None)
    if not events:
        return ""
    lines = [f"  {t:8.1f}s  worker {worker} {what}" for t, worker, what in events[-shown:]]
    return f"\njoins and leaves ({len(events)}, the latest {len(lines)}):\n" + "\n".join(lines)


def shutdown_cluster(
    cluster: ClusterSpec,
    timeout: float,
    access: Credentials = NO_CREDENTIALS,
    reason: str = "",
    secret: RunSecret | None = None,
) -> int:
    """Ask every PS of `cluster` to drain and stop (an admin call when the PS check tokens); prints one
    JSON line per PS with its answer. Exit code 0 when every PS accepted, else 1. With the `secret` of a
    local run, a PS that does not prove it belongs to the run is sent nothing (its line says so)."""
    request = codec.encode({"reason": reason} if reason else {})
    accepted = 0
    for index, address in enumerate(cluster.ps):
        with open_channel(address, access.tls) as channel:
            if secret is not None and not proves(channel, SHARD, ps_node(index), secret, timeout):
                why = f"{UNPROVEN}: the node at {address} did not prove it is ps {index} of this run"
                why += "; nothing was sent to it"
                print(json.dumps({"ps": index, "address": address, "draining": False, "error": why}), flush=True)
                continue
            try:
                reply = codec.decode(
                    channel.unary_unary(f"/{SHARD}/Shutdown")(request, timeout=timeout, metadata=access.metadata)
                )
                outcome = {"ps": index, "address": address, "draining": True, "version": reply.meta.get("version")}
                accepted += 1
            except grpc.RpcError as exc:
                outcome = {
                    "ps": index,
                    "address": address,
                    "draining": False,
                    "error": f"{exc.code().name}: {exc.details()}",
                }
        print(json.dumps(outcome), flush=True)
    return 0 if accepted == len(cluster.ps) else 1
