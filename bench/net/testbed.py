"""An emulated network on one machine: hosts as network namespaces on a bridge, each link shaped with tc.

Layout, for a testbed tagged psnet-<pid>-<hex> (the pid says whose it is; the hex tells two testbeds of one
process apart):
- a switch namespace (<tag>-sw) holds the bridge br0; a fresh namespace has no firewall rules, so nothing of
  the root namespace (Docker's FORWARD policy, br_netfilter) touches the hosts' traffic;
- each host namespace (<tag>-<host>) has `lo` up and `eth0` = 10.79.0.N/24, a veth whose peer (pN) is a
  port of the bridge. Nothing joins the root namespace: traffic stays between the namespaces made here.

A link is shaped in both directions by a token bucket (tc's `tbf`): on the host's eth0 (what it sends) and
on its bridge port (what it receives). This kernel has no `netem`, so links have no added delay: the
round trip is the veth's (tens of microseconds), far below a real network's.

Each host's processes are pinned to its CPUs (taskset), so that hosts do not share cores the way
processes of one host would. Everything made here (processes, namespaces; the qdiscs go with their
interfaces) is removed by `close()`, which `with Network(...)` calls on any exit, Ctrl-C included.
Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) for the namespaces; `require_root()` says so clearly.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "psnet-"
SUBNET = "10.79.0"  # each testbed's own namespaces: no clash with the root's routes or another testbed
COMMAND_TIMEOUT_S = 30  # one ip / tc call
STOP_GRACE_S = 15  # a process asked to stop (SIGTERM) before it is killed
TOOLS = ("ip", "tc", "taskset")
BURST_S = 0.001  # the token bucket's depth, in seconds of the rate (tbf)
TBF_LATENCY = "10ms"  # how long a packet may wait in the bucket's queue before it is dropped


class NetworkError(RuntimeError):
    """The testbed cannot be made here, or a command making it failed."""


def command(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and done.returncode:
        raise NetworkError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why the testbed cannot be made here, or None."""
    if os.geteuid() != 0:
        return (
            "the emulated network needs root: network namespaces need CAP_NET_ADMIN and CAP_SYS_ADMIN (run with sudo)"
        )
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"the emulated network needs {', '.join(missing)} (iproute2, util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"  # root in a container may still lack CAP_SYS_ADMIN
    made = command("ip", "netns", "add", probe, check=False)
    command("ip", "netns", "del", probe, check=False)
    if made.returncode:
        return f"the emulated network cannot make a network namespace: {made.stderr.strip()}"
    return None


def require_root() -> None:
    why = unavailable()
    if why:
        raise NetworkError(why)


def namespaces() -> list[str]:
    return [line.split()[0] for line in command("ip", "netns", "list").stdout.splitlines() if line.strip()]


def remove_stale() -> None:
    """Namespaces of testbeds whose process died before it could clean up (kill -9), and that nothing runs
    in. Never those of a live process: another testbed beside this one keeps its own."""
    for name in namespaces():
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists() and not command("ip", "netns", "pids", name).stdout:
            log.info("removing namespace %s of a dead testbed", name)
            command("ip", "netns", "del", name, check=False)


def tbf(rate_gbit: float) -> list[str]:
    """tc arguments of a token bucket at this rate. A full bucket goes out at the veth's own speed: a message
    sent after an idle spell (a step's compute) gets BURST_S of the rate free, so the bucket is kept small
    (a 1 MB bucket took 19% off a 5.3 MB push at 1 Gbit/s); 64 KiB at least, one GSO packet."""
    burst = max(int(rate_gbit * 1e9 / 8 * BURST_S), 64 * 1024)
    return ["tbf", "rate", f"{rate_gbit}gbit", "burst", str(burst), "latency", TBF_LATENCY]


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    cpus: str  # taskset's list: "0", "1", "0-1"
    port: str  # its side of the bridge, in the switch namespace


@dataclass
class Network:
    """Hosts on one bridge. `add_host`, `shape`, `start` (a pinned process in a host), `close`."""

    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}")
    hosts: dict[str, Host] = field(default_factory=dict)
    processes: list[subprocess.Popen] = field(default_factory=list)
    rate_gbit: float | None = None  # None: links not shaped

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def __enter__(self) -> Network:
        require_root()
        remove_stale()
        try:
            command("ip", "netns", "add", self.switch)
            for args in (["link", "add", "name", "br0", "type", "bridge"], ["link", "set", "br0", "up"]):
                command("ip", "-n", self.switch, *args)
        except BaseException:
            self.close()  # `with` calls __exit__ only once __enter__ returned
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_host(self, name: str, cpus: str) -> Host:
        number = len(self.hosts) + 2
        host = Host(name, f"{self.tag}-{name}", f"{SUBNET}.{number}", cpus, f"p{number}")
        self.hosts[name] = host
        command("ip", "netns", "add", host.namespace)
        command("ip", "-n", host.namespace, "link", "set", "lo", "up")
        command(
            "ip",
            "-n",
            self.switch,
            "link",
            "add",
            "name",
            host.port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            host.namespace,
        )
        command("ip", "-n", self.switch, "link", "set", host.port, "master", "br0", "up")
        command("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        command("ip", "-n", host.namespace, "link", "set", "eth0", "up")
        if self.rate_gbit:
            self._shape(host, self.rate_gbit)
        log.info("host %s: namespace %s, %s, CPUs %s", name, host.namespace, host.address, cpus)
        return host

    def shape(self, rate_gbit: float | None) -> None:
        """Every host's link at this rate, both ways (None: unshaped, the veth's own speed)."""
        self.rate_gbit = rate_gbit
        for host in self.hosts.values():
            self._shape(host, rate_gbit)

    def _shape(self, host: Host, rate_gbit: float | None) -> None:
        for namespace, device in ((host.namespace, "eth0"), (self.switch, host.port)):
            command("tc", "-n", namespace, "qdisc", "del", "dev", device, "root", check=False)  # none yet: fine
            if rate_gbit:
                command("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf(rate_gbit))

    def qdiscs(self) -> list[str]:
        """The token buckets in place, one line each (for checks and logs)."""
        found = []
        for host in self.hosts.values():
            for namespace, device in ((host.namespace, "eth0"), (self.switch, host.port)):
                out = command("tc", "-n", namespace, "qdisc", "show", "dev", device).stdout
                found += [f"{host.name} {device}: {line}" for line in out.splitlines() if "tbf" in line]
        return found

    def argv(self, host: Host, argv: list[str]) -> list[str]:
        """`argv` in the host's namespace, on its CPUs. `ip netns exec` and taskset both exec, so the PID
        Popen returns is the command's own."""
        return ["ip", "netns", "exec", host.namespace, "taskset", "-c", host.cpus, *argv]

    def start(self, host: Host, argv: list[str], env: dict[str, str], out: Path) -> subprocess.Popen:
        """A process in `host`, its output (stdout and stderr) in the file `out`. Its own session: a
        Ctrl-C reaches this process alone, which then stops it (close)."""
        with open(out, "w") as sink:
            proc = subprocess.Popen(
                self.argv(host, argv),
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.processes.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM) -> int:
        """Stops one process we started (its group), killing it after STOP_GRACE_S; returns its exit code."""
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("PID %d did not stop in %d s: killed", proc.pid, STOP_GRACE_S)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(STOP_GRACE_S)
        if proc in self.processes:
            self.processes.remove(proc)
        return proc.returncode

    def leftovers(self) -> list[str]:
        """This testbed's namespaces still there (none after close)."""
        return [name for name in namespaces() if name.startswith(self.tag)]

    def close(self) -> None:
        """Processes first (a namespace outlives `ip netns del` while something runs in it), then every
        namespace: their veths, the bridge and the qdiscs go with them."""
        for proc in list(self.processes):
            try:
                self.stop(proc)
            except (ProcessLookupError, subprocess.TimeoutExpired) as error:
                log.warning("stopping PID %d: %s", proc.pid, error)
        for host in self.hosts.values():
            command("ip", "netns", "del", host.namespace, check=False)
        command("ip", "netns", "del", self.switch, check=False)
        left = self.leftovers()
        if left:
            log.error("namespaces left behind: %s", left)
