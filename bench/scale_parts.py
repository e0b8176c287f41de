"""Helpers of bench/scale.py: PS processes, /proc readings, an RSS sampler, id generators, timed children.

Every process started here is stopped by its PID (`PSProcess.stop`, `run_measured`'s kill on its
deadline); `Workdir` removes its temporary directory whatever happens.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from paramserver.client.ps_client import hello
from paramserver.transport.grpc_transport import GrpcChannel

READY = "PARAMSERVER_READY"
TICKS = os.sysconf("SC_CLK_TCK")
MiB = 1 << 20


# ---- /proc ------------------------------------------------------------------------------------
def memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM (the peak) of `pid`, in bytes."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux: `echo 5 > /proc/PID/clear_refs`); False if refused."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Samples VmRSS of `pid` every `every` seconds in a thread while in its `with` block; `peak`."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        self.pid, self.every, self.peak = pid, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, memory(self.pid)["VmRSS"])
            except (OSError, KeyError):
                return  # the process is gone
            self._stop.wait(self.every)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ---- ids --------------------------------------------------------------------------------------
def keys(ranks: np.ndarray) -> np.ndarray:
    """The id of each rank: splitmix64's finalizer, a bijection of 64-bit integers, so that ranks
    next to each other (the hot ones of a Zipf law) land far apart, as real ids do."""
    z = ranks.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))).view(np.int64)


def new_ids(start: int, count: int) -> np.ndarray:
    """Distinct ids of ranks start..start+count-1 (the fills: never seen before)."""
    return keys(np.arange(start, start + count, dtype=np.int64))


def zipf_ids(rng: np.random.Generator, draws: int, space: int) -> np.ndarray:
    """The distinct ids of `draws` Zipf(1.1) ranks folded into [0, space)."""
    ranks = (rng.zipf(1.1, draws) - 1) % space
    return np.unique(keys(ranks))


def uniform_ids(rng: np.random.Generator, draws: int, space: int) -> np.ndarray:
    """The distinct ids of `draws` ranks drawn uniformly from [0, space)."""
    return np.unique(keys(rng.integers(0, space, draws)))


# ---- PS processes -----------------------------------------------------------------------------
class PSProcess:
    """`python -m paramserver node --role ps` on a free port; its stderr goes to a log file in `logdir`.
    `PSProcess.stop_all()` stops every one not stopped yet (whatever interrupted the code that started it)."""

    live: set[PSProcess] = set()

    def __init__(self, logdir: str, extra: list[str], index: int = 0, log_level: str = "WARNING") -> None:
        command = [sys.executable, "-m", "paramserver", "--log-level", log_level, "node", "--role", "ps",
                   "--index", str(index), "--bind", "127.0.0.1:0", *extra]  # fmt: skip
        self.log = Path(logdir) / f"ps-{index}-{time.monotonic_ns()}.log"
        self.started = time.perf_counter()
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True)
        PSProcess.live.add(self)
        self.pid, self.address, self.ready_s = self.proc.pid, "", 0.0
        self.channel: GrpcChannel | None = None
        self._lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.append(line)

    def wait_ready(self, timeout: float) -> GrpcChannel:
        """Wait for the PS's ready line, then connect; raises RuntimeError (with its log's tail)."""
        deadline = time.monotonic() + timeout
        while not any(line.startswith(READY) for line in self._lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {self.proc.returncode}" if self.proc.returncode is not None else "not ready"
                raise RuntimeError(f"ps {self.pid} {why} after {time.perf_counter() - self.started:.1f}s: "
                                   f"{self.log_tail()}")  # fmt: skip
            time.sleep(0.01)
        self.ready_s = time.perf_counter() - self.started
        self.address = next(line for line in self._lines if line.startswith(READY)).split()[-1]
        self.channel = GrpcChannel(self.address, 1 << 30)
        self.channel.wait_ready(max(1.0, deadline - time.monotonic()))
        return self.channel

    def log_tail(self, chars: int = 1500) -> str:
        return self.log.read_text()[-chars:] if self.log.exists() else ""

    def rows(self, table: str) -> int:
        return int(hello(self.channel, 60)["tables"].get(table, {}).get("rows", 0))

    def table_bytes(self, table: str) -> int:
        return int(hello(self.channel, 60)["tables"].get(table, {}).get("bytes", 0))

    def stop(self) -> None:
        """SIGTERM (the PS drains), SIGKILL after 20 s; by PID, never by name."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        PSProcess.live.discard(self)

    @classmethod
    def stop_all(cls) -> None:
        for ps in list(cls.live):
            ps.stop()


def ps_flags(ps_args: str, checkpoint_dir: str | None = None, resume: bool = False) -> list[str]:
    """A PS's extra flags: its checkpoint directory (and --resume), then `--ps-args` as given."""
    flags = ["--checkpoint-dir", checkpoint_dir] if checkpoint_dir else []
    return [*flags, *(["--resume"] if resume else []), *shlex.split(ps_args)]


# ---- children measured as a whole -------------------------------------------------------------
def run_measured(command: list[str], timeout: float) -> dict:
    """Run `command` to its end (killed by PID past `timeout`): exit code, seconds, peak RSS (the
    kernel's ru_maxrss of the child, from wait4), and the tails of its output."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        lock, exited = threading.Lock(), []

        def kill() -> None:  # the child is not reaped before `exited` is set: its PID is still its own
            with lock:
                if not exited:
                    os.kill(proc.pid, signal.SIGKILL)

        killer = threading.Timer(timeout, kill)
        killer.start()
        try:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped yet
        except BaseException:  # Ctrl-C: the child goes too
            kill()
            raise
        finally:
            with lock:
                exited.append(True)
            killer.cancel()
            _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        out.seek(0), err.seek(0)
        return {"rc": proc.returncode, "time_s": round(time.perf_counter() - started, 2),
                "peak_rss_mb": round(usage.ru_maxrss * 1024 / MiB, 1),
                "stdout": out.read()[-4000:], "stderr": err.read()[-1500:]}  # fmt: skip


# ---- figures ----------------------------------------------------------------------------------
def mb(value: float) -> float:
    return round(value / MiB, 1)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


class Workdir:
    """A temporary directory under `parent`, removed on leaving (an exception, Ctrl-C included)."""

    def __init__(self, parent: str) -> None:
        os.makedirs(parent, exist_ok=True)
        self.path = tempfile.mkdtemp(prefix="scale-", dir=parent)

    def sub(self, name: str) -> str:
        return tempfile.mkdtemp(prefix=f"{name}-", dir=self.path)

    def __enter__(self) -> Workdir:
        return self

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
