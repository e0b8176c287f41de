"""A node's config from its Slurm job step's environment: `paramserver node` started by `srun` needs no
TF_CONFIG (docs/configuration.md, "Slurm: the node's role from the job").

Every task of the step reads the same variables and so builds the same cluster:
- the step's ranks laid out on its nodes as Slurm does (SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE,
  block distribution unless SLURM_DISTRIBUTION says cyclic); a heterogeneous step lays out each
  component on its own nodes (SLURM_JOB_NODELIST_HET_GROUP_n, SLURM_TASKS_PER_NODE_HET_GROUP_n);
- roles by rank: a heterogeneous job's component 0 is the PS, else the first `slurm_ps` ranks; the
  next rank is the chief (worker 0), the rest workers;
- each node's address by resolving its name; each task's port is a base port (`slurm_port`, else
  derived from SLURM_JOB_ID) + 2 x its number among the tasks at that address (SLURM_LOCALID when
  every node has an address of its own); a PS's tensor stream takes the next port.
This task's own SLURM_PROCID picks its role; its SLURMD_NODENAME, SLURM_GTIDS and SLURM_LOCALID, where
set, must agree with the layout (else a ConfigError: Slurm placed the tasks some other way).
Called once per node at start; thread-safe (reads only what it is given).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Mapping

from paramserver.base.config import ClusterSpec, NodeConfig, Task
from paramserver.base.errors import ConfigError
from paramserver.base.options.options import Options
from paramserver.launch.slurm.hostlist import MAX_TASKS, expand_counts, expand_hosts

log = logging.getLogger(__name__)

PROCID = "SLURM_PROCID"
STEP_NODES = "SLURM_STEP_NODELIST"
STEP_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"
HET_SIZE = "SLURM_HET_SIZE"
RESOLVE_TIMEOUT_S = 30.0  # resolving every node name of the step, all together
MAX_COMPONENTS = 128  # of a heterogeneous job
PORT_FLOOR, PORTS_PER_JOB, JOB_SLOTS = 20000, 20, 2000  # the derived base: 20000 + (job id % 2000) * 20
Resolver = Callable[[str], str]


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    """Whether this process is a task of a Slurm job step (srun), not a batch script or a login shell."""
    return bool(environ.get(PROCID)) and bool(environ.get(STEP_NODES))


def slurm_config(environ: Mapping[str, str], options: Options, resolve: Resolver | None = None) -> NodeConfig:
    """This task's NodeConfig: the whole cluster of the step and this rank's (type, index).

    `resolve` turns a node name into an IP address (default: `resolve_host`). A requeued job
    (SLURM_RESTART_COUNT > 0) with a checkpoint_dir resumes; a PS's stream port is its port + 1
    unless `options` fix one. Raises ConfigError naming what is wrong or missing."""
    nodes = step_layout(environ, options.slurm_ps)
    ps_count = _ps_count(environ, options.slurm_ps, len(nodes))
    rank = _number(environ, PROCID, len(nodes) - 1)
    _check_own_placement(environ, nodes, rank)
    addresses = resolve_nodes(dict.fromkeys(nodes), resolve or resolve_host)
    ports = _ports(nodes, addresses, _base_port(environ, options))
    listed = [_joined(addresses[node], port) for node, port in zip(nodes, ports, strict=True)]
    cluster = ClusterSpec(ps=tuple(listed[:ps_count]), chief=(listed[ps_count],), worker=tuple(listed[ps_count + 1 :]))
    task = role_of(rank, ps_count)
    if task.type == "ps" and options.stream_port == 0:  # fixed, so that a firewall can name it
        options = dataclasses.replace(options, stream_port=ports[rank] + 1)
    if _number(environ, "SLURM_RESTART_COUNT", None, default=0) > 0 and options.checkpoint_dir:
        options = dataclasses.replace(options, resume=True)  # a requeued job goes on from its checkpoint
    log.info(
        "Slurm rank %d of %d on %s: %s %d at %s (%d PS)",
        rank,
        len(nodes),
        nodes[rank],
        task.type,
        task.index,
        listed[rank],
        ps_count,
    )
    return NodeConfig(cluster, task, options)


def role_of(rank: int, ps_count: int) -> Task:
    """The task of a rank: the first `ps_count` ranks are PS, the next the chief, the rest workers."""
    if rank < ps_count:
        return Task("ps", rank)
    return Task("chief", 0) if rank == ps_count else Task("worker", rank - ps_count - 1)


def step_layout(environ: Mapping[str, str], slurm_ps: int) -> list[str]:
    """The node of each rank of the step, by rank (a heterogeneous step: component by component)."""
    distribution = _distribution(environ)
    het_size = _number(environ, HET_SIZE, MAX_COMPONENTS, default=1)
    if het_size < 2:
        nodes = expand_hosts(environ[STEP_NODES], STEP_NODES)
        counts = expand_counts(_required(environ, STEP_TASKS_PER_NODE), STEP_TASKS_PER_NODE)
        if len(counts) != len(nodes):
            raise ConfigError(
                f"{STEP_TASKS_PER_NODE} counts tasks on {len(counts)} nodes, {STEP_NODES} names {len(nodes)}"
            )
        placed = place(nodes, counts, distribution)
    else:
        placed = []
        for component in range(het_size):
            component_nodes, counts = _component(environ, component)
            placed += place(component_nodes, counts, distribution)
            if len(placed) > MAX_TASKS:
                raise ConfigError(f"the heterogeneous job's components hold more than {MAX_TASKS} tasks")
    step_tasks = _number(environ, "SLURM_STEP_NUM_TASKS", None, default=len(placed))
    if step_tasks != len(placed):
        raise ConfigError(
            f"SLURM_STEP_NUM_TASKS={step_tasks}, but the step's layout holds {len(placed)} tasks"
            + ("; run one step over every component: srun --het-group=0-N" if het_size >= 2 else "")
        )
    return placed


def place(nodes: list[str], counts: list[int], distribution: str = "block") -> list[str]:
    """The node of each rank, `counts[i]` tasks on `nodes[i]`: block (consecutive ranks share a node,
    Slurm's default) or cyclic (one rank per node in turn, skipping full nodes)."""
    if distribution == "block":
        return [node for node, count in zip(nodes, counts, strict=True) for _ in range(count)]
    placed: list[str] = []
    left = dict(zip(nodes, counts, strict=True))
    while left:  # each round walks only the nodes with tasks left: as many steps as tasks in all
        for node in list(left):
            placed.append(node)
            left[node] -= 1
            if not left[node]:
                del left[node]
    return placed


def resolve_host(name: str) -> str:
    """A node name's IP address, IPv4 first (getaddrinfo: DNS, /etc/hosts). Raises OSError."""
    found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    found.sort(key=lambda info: info[0] != socket.AF_INET)
    if not found:
        raise OSError(f"no address for {name}")
    return str(found[0][4][0])


def resolve_nodes(names: Iterable[str], resolve: Resolver, timeout_s: float = RESOLVE_TIMEOUT_S) -> dict[str, str]:
    """Each name's address, all within `timeout_s` (a stuck resolver: ConfigError; its daemon thread is
    left to finish by itself). A name that does not resolve, or loopback addresses mixed with others
    (a node the others could not reach), is a ConfigError naming it and saying what to do."""
    wanted = list(names)
    found: dict[str, str] = {}
    failed: list[tuple[str, Exception]] = []

    def work() -> None:
        for name in wanted:
            try:
                found[name] = resolve(name)
            except (OSError, UnicodeError) as exc:
                failed.append((name, exc))
                return

    worker = threading.Thread(target=work, name="slurm-resolve", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise ConfigError(
            f"resolving the Slurm step's {len(wanted)} node names took over {timeout_s:.0f} s "
            f"({len(found)} done); check this node's resolver (/etc/resolv.conf, /etc/hosts)"
        )
    if failed:
        name, exc = failed[0]
        raise ConfigError(
            f"Slurm node {name!r} does not resolve to an address here ({exc}); every task needs every node "
            "name of the step to resolve (DNS or /etc/hosts on each node), so that it can reach the others"
        )
    _check_reachable(found)
    return found


def _check_reachable(addresses: Mapping[str, str]) -> None:
    """All nodes on loopback (one host) or none: a node resolving to 127.x beside others is unreachable."""
    loopback = sorted(name for name, address in addresses.items() if _is_loopback(address))
    if loopback and len(loopback) < len(addresses):
        other = next(name for name in addresses if name not in loopback)
        raise ConfigError(
            f"Slurm node {loopback[0]!r} resolves to the loopback address {addresses[loopback[0]]} here, while "
            f"{other!r} resolves to {addresses[other]}: the other nodes could not reach it; make each node "
            "name resolve to an address the other nodes reach (DNS or /etc/hosts)"
        )


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _ports(nodes: list[str], addresses: Mapping[str, str], base: int) -> list[int]:
    """Each rank's port: base + 2 x its number among the ranks at its address (its SLURM_LOCALID when
    every node has an address of its own; nodes sharing one, e.g. all on 127.0.0.1, never collide)."""
    taken: dict[str, int] = {}
    ports = []
    for node in nodes:
        slot = taken.get(addresses[node], 0)
        taken[addresses[node]] = slot + 1
        ports.append(base + 2 * slot)
    if ports and max(ports) + 1 > 65535:
        raise ConfigError(
            f"{max(taken.values())} tasks at one address from base port {base} need ports past 65535; "
            "give a lower slurm_port or fewer tasks per node"
        )
    return ports


def _base_port(environ: Mapping[str, str], options: Options) -> int:
    if options.slurm_port:
        return options.slurm_port
    job = _number(environ, "SLURM_JOB_ID", None)
    return PORT_FLOOR + (job % JOB_SLOTS) * PORTS_PER_JOB  # jobs sharing a node mostly differ


def _ps_count(environ: Mapping[str, str], slurm_ps: int, tasks: int) -> int:
    """Component 0's tasks in a heterogeneous job, else `slurm_ps`; at least one task must be left to work."""
    het = _number(environ, HET_SIZE, MAX_COMPONENTS, default=1) >= 2
    count = _number(environ, "SLURM_NTASKS_HET_GROUP_0", MAX_TASKS) if het else slurm_ps
    if count >= tasks:
        source = "component 0 of the heterogeneous job" if het else f"slurm_ps={slurm_ps}"
        raise ConfigError(
            f"the Slurm step has {tasks} tasks and {source} makes {count} of them PS, leaving no worker: "
            "start more tasks (srun -n) or fewer PS (--slurm-ps)"
        )
    return count


def _component(environ: Mapping[str, str], component: int) -> tuple[list[str], list[int]]:
    """A heterogeneous job's component: its nodes and the tasks on each."""
    nodes_name, counts_name = f"SLURM_JOB_NODELIST_HET_GROUP_{component}", f"SLURM_TASKS_PER_NODE_HET_GROUP_{component}"
    nodes = expand_hosts(_required(environ, nodes_name), nodes_name)
    counts = expand_counts(_required(environ, counts_name), counts_name)
    tasks = _number(environ, f"SLURM_NTASKS_HET_GROUP_{component}", MAX_TASKS)
    if len(counts) != len(nodes) or sum(counts) != tasks:
        raise ConfigError(
            f"component {component} of the heterogeneous job: {counts_name} counts {sum(counts)} tasks on "
            f"{len(counts)} nodes, {nodes_name} names {len(nodes)} nodes and SLURM_NTASKS_HET_GROUP_{component} "
            f"says {tasks} tasks"
        )
    return nodes, counts


def _check_own_placement(environ: Mapping[str, str], nodes: list[str], rank: int) -> None:
    """This task's node, the ranks beside it and its local id, where Slurm says them, match the layout."""
    node = nodes[rank]
    beside = [r for r, n in enumerate(nodes) if n == node]
    said = {
        "SLURMD_NODENAME": (environ.get("SLURMD_NODENAME"), node),
        "SLURM_GTIDS": (environ.get("SLURM_GTIDS"), ",".join(map(str, beside))),
        "SLURM_LOCALID": (environ.get("SLURM_LOCALID"), str(beside.index(rank))),
    }
    for name, (value, expected) in said.items():
        if value is not None and value != expected:
            raise ConfigError(
                f"Slurm placed rank {rank} otherwise than the {_distribution(environ)} layout of the step's "
                f"nodes and task counts ({name}={value[:200]!r}, the layout gives {expected[:200]!r}); start "
                "the step with srun's default task distribution (--distribution=block, or cyclic)"
            )


def _distribution(environ: Mapping[str, str]) -> str:
    """How srun spread the ranks over the nodes: block (the default) or cyclic; others are refused."""
    given = environ.get("SLURM_DISTRIBUTION", "block")
    first = given.split(":")[0].split(",")[0]
    if first in ("block", "cyclic"):
        return first
    if first in ("", "*"):
        return "block"
    raise ConfigError(
        f"SLURM_DISTRIBUTION={given[:100]!r}: the roles of the ranks are known for the block (default) "
        "and cyclic distributions only; start the step with srun --distribution=block"
    )


def _joined(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _required(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if not value:
        raise ConfigError(f"{name} is not set: is this a task of a Slurm job step (srun)?")
    return value


def _number(environ: Mapping[str, str], name: str, most: int | None, default: int | None = None) -> int:
    """A whole number from 0 up to `most` (None: no cap) held by `name`; `default` when unset."""
    text = environ.get(name)
    if not text and default is not None:
        return default
    text = _required(environ, name)
    if not text.isascii() or not text.isdigit() or len(text) > 18 or most is not None and int(text) > most:
        limit = f" up to {most}" if most is not None else ""
        raise ConfigError(f"{name} must be a whole number{limit}, got {text[:100]!r}")
    return int(text)
