"""Hosts on one machine: a network namespace per node, each with its own IP address on one bridge.

Layout, for a test tagged <SESSION><hex> (SESSION: psns-<pid>-<random hex>-, one per test process):
- a switch namespace (<tag>-sw) holds the bridge br0;
- each host namespace (<tag>-<node>) has `lo` up and `eth0` = 10.77.K.i/24, a veth whose peer is
  on the bridge;
- the root namespace gets 10.77.K.1/24 on a veth (psr<hex>) whose peer is on the bridge, so the
  test process reaches every node (Hello counters) without entering a namespace.
The bridge lives in a namespace of its own, not in the root one: a root namespace's firewall
(Docker sets the FORWARD policy to DROP, and br_netfilter sends bridged frames through it) would
drop the nodes' traffic; a fresh namespace has no rules.

Everything is deleted at teardown, even on failure; what an earlier test of this process left behind
(a teardown cut short) is deleted before the next. Only this process's namespaces (named with its
SESSION) are ever deleted, so that test processes side by side (pytest-xdist workers, two runs) leave
each other's alone; they choose their subnets one at a time (a lock file). Namespaces of a test process
that was killed stay: `ip netns list | grep psns-` shows them. Needs root (CAP_NET_ADMIN and
CAP_SYS_ADMIN) and iproute2; `unavailable()` says why not, probed once.
"""

from __future__ import annotations

import fcntl
import functools
import os
import random
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.restart_loop import RestartLoop

PREFIX = "psns-"
# This test process's namespaces, and only them, start with SESSION: the pid tells a person whose they
# are, the random part keeps a reused pid (or one in another PID namespace) from claiming them.
SESSION = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
# Held while a test process picks its subnet and puts it on its root-side veth.
SUBNET_LOCK = Path(tempfile.gettempdir()) / "paramserver-multihost-subnet.lock"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


@functools.cache
def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None. Probed once per test session."""
    if os.geteuid() != 0:
        return "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN for `ip netns add`)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip`"
    name = f"{SESSION}probe"
    try:
        veth = ["-n", name, "link", "add", "name", "a", "type", "veth", "peer", "name", "b"]
        for args in (["netns", "add", name], veth):
            done = ip(*args, check=False)
            if done.returncode:
                return f"`ip {' '.join(args)}` failed: {done.stderr.strip()}"
        return _exec_keeps_the_pid(name)
    finally:
        ip("netns", "del", name, check=False)


def _exec_keeps_the_pid(name: str) -> str | None:
    """`ip netns exec` must exec the command, so that killing the PID we started kills the node."""
    proc = subprocess.Popen(["ip", "netns", "exec", name, "sh", "-c", "echo $$"], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    if proc.returncode or out.strip() != str(proc.pid):
        return f"`ip netns exec` ran its command as PID {out.strip()!r}, not {proc.pid} (code {proc.returncode})"
    return None


def remove_leftovers() -> None:
    """Namespaces an earlier test of this process left behind and that nothing runs in; never another
    process's (theirs do not start with SESSION)."""
    for line in ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(SESSION) and not ip("netns", "pids", name, check=False).stdout.strip():
            ip("netns", "del", name, check=False)


@contextmanager
def subnet_lock() -> Iterator[None]:
    """One test process at a time between reading the routes and adding its own (free_subnet, then the
    address on its veth): two side by side would otherwise pick the same free subnet."""
    with open(SUBNET_LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def free_subnet() -> str:
    """A 10.77.K prefix no route or address of the root namespace covers yet (another run's included).
    Call under subnet_lock()."""
    taken = ip("-4", "route", "show").stdout + ip("-4", "addr", "show").stdout
    free = [k for k in range(1, 255) if f"10.77.{k}." not in taken]
    if not free or "10.77.0.0/16" in taken or "10.0.0.0/8" in taken:
        raise RuntimeError(f"no free 10.77.K.0/24 subnet: {taken}")
    return f"10.77.{random.choice(free)}"


class Hosts:
    """The namespaces of one test, and the nodes started in them (RestartLoops)."""

    def __init__(self, procs) -> None:
        self.procs = procs
        self.tag = f"{SESSION}{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-sw"
        self.root_link = f"psr{secrets.token_hex(5)}"  # root namespace interface names: 15 characters at most
        self.subnet = ""  # 10.77.K, chosen by setup()
        self.namespaces: dict[str, str] = {}  # host -> namespace
        self.ips: dict[str, str] = {}  # host -> its address
        self.nodes: dict[str, RestartLoop] = {}

    def setup(self) -> None:
        ip("netns", "add", self.switch)
        for args in (["link", "add", "name", "br0", "type", "bridge"], ["link", "set", "br0", "up"],
                     ["link", "set", "lo", "up"]):
            ip("-n", self.switch, *args)
        ip("link", "add", "name", self.root_link, "type", "veth", "peer", "name", "root", "netns", self.switch)
        with subnet_lock():
            self.subnet = free_subnet()
            ip("addr", "add", f"{self.subnet}.1/24", "dev", self.root_link)
            ip("link", "set", self.root_link, "up")
        ip("-n", self.switch, "link", "set", "root", "master", "br0", "up")
        print(f"multihost: switch namespace {self.switch}, root side {self.root_link} {self.subnet}.1/24")

    def add(self, host: str) -> str:
        """A new host namespace `host` on the bridge; returns its address."""
        number = len(self.ips) + 2
        namespace, address = f"{self.tag}-{host}", f"{self.subnet}.{number}"
        ip("netns", "add", namespace)
        self.namespaces[host], self.ips[host] = namespace, address
        ip("-n", namespace, "link", "set", "lo", "up")
        ip("-n", self.switch, "link", "add", "name", f"p{number}", "type", "veth", "peer", "name", "eth0",
           "netns", namespace)
        ip("-n", self.switch, "link", "set", f"p{number}", "master", "br0", "up")
        ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", namespace, "link", "set", "eth0", "up")
        print(f"multihost: {host} in namespace {namespace} at {address}")
        return address

    def start(self, host: str, argv: list[str], env: dict[str, str], max_restarts: int = 0) -> RestartLoop:
        """`argv` run inside `host`'s namespace, restarted on failure up to `max_restarts` times."""
        node = RestartLoop(self.procs, argv, env, self.namespaces[host], max_restarts=max_restarts, name=host)
        self.nodes[host] = node.start()
        return node

    def logs(self) -> str:
        return "\n".join(node.log() for node in self.nodes.values())

    def teardown(self) -> None:
        """Nodes stopped first (no restart), then every namespace and the root side's veth."""
        for node in self.nodes.values():
            node.stop()
        self.procs.cleanup()
        for namespace in [*self.namespaces.values(), self.switch]:
            ip("netns", "del", namespace, check=False)
        ip("link", "del", self.root_link, check=False)  # gone with its peer already, unless setup stopped half-way
