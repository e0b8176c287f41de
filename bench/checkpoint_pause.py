"""Checkpoint pause: how long workers that train steadily stop while a checkpoint is written, and
while another PS restores its shard under partial recovery.

`paramserver run --ps 2 --workers 2 --recovery partial` on bench/checkpoint_pause_worker.py: real
PS and worker processes over gRPC. The workers fill a `--rows`-row dim-16 Adagrad table (lookups
of new ids, each worker its share), then train a CTR-like step (a batch of Zipf(1.1) ids, a
push) and print every step's wall time. This process decides the phases, `--settle-s` of steady
steps between them:

1. checkpoint: the chief asks for checkpoint 1 (a base: every row) through the coordinator; the
   window is from that request to its MANIFEST.json (the commit) appearing; then
   `--deltas` more (each a delta on the one before: the rows changed since).
2. restore: kill -9 ps1; the launcher starts it again with --resume, it restores its shard from
   the newest checkpoint while ps0 keeps its state; the window is from the kill to the last
   worker's "ps 1 is back" line.
3. stop: the workers end (a final checkpoint is written, outside every figure).

For each checkpoint: `step_max_s` (the longest step any worker saw overlapping the window, and
each worker's), `window_s`, `steps_in_window` and `step_p50_ms_in_window` (the steps the workers
finished within it, and their median: training during the write), `files_from_s` (the request
to its directory appearing: the workers meeting at its barrier), `write_s` (the chief's
"committed ... in X s"), each shard's write seconds and bytes kept aside (copy-on-write) as it
logged them, `bytes` (the manifest's). For the restore: each worker's longest step in its
window, `restore_s` (the kill to the last worker's first step after the shard came back), the
workers' own wait, and what the new ps1 logged (seconds after the kill: serving, its rows
restored; its seconds choosing the checkpoint). `steady`: step p50/p99/max outside every
window. `peak_rss_mb`: the run's processes together (sampled every 0.25 s). Everything lives in
a temporary directory under `--workdir`, removed at the end; a run that did not end by itself
(an error, Ctrl-C, SIGTERM) is killed, its nodes by PID.

    python bench/checkpoint_pause.py [--rows 20000000] [--settle-s 15] [--deltas 1] [--no-restore]
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "bench" / "checkpoint_pause_worker.py")
STEP = re.compile(r"^\[worker(\d+)\] STEP \d+ \d+ ([\d.]+) ([\d.]+)$")
COMMITTED = re.compile(r"(ckpt-\d+): committed \((\d+) bytes.*?\) in ([\d.]+)s")
SHARD_WROTE = re.compile(r"(ckpt-\d+): shard (\d+) wrote (\d+) bytes in ([\d.]+)s.*?kept aside for it: (\d+) bytes")
PS1_SERVING = r"^\[ps1\] .*ps 1 serving on"
PS1_SOURCE = re.compile(r"^\[ps1\] .*resuming from \S+ \(step \d+\) in ([\d.]+)s")
PS1_ROWS = re.compile(r"^\[ps1\] .*table \S+ restored with (\d+) rows")
BACK = re.compile(r"^\[worker(\d+)\] .*ps \d+ is back, restored from (\S+) after ([\d.]+)s")
WARMUP_STEPS = 3  # a worker's first steps (registration, first replies) count in no figure


class Run:
    """One `paramserver run`: its lines (with the time each arrived), the workers' steps, the
    checkpoints seen in its directory (first seen, committed) and its processes' memory."""

    def __init__(self, argv: list[str], checkpoint_dir: Path) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.lines: list[tuple[float, str]] = []
        self.steps: dict[int, list[tuple[float, float]]] = {}  # worker -> (end, seconds) of each step
        self.seen: dict[str, float] = {}  # checkpoint -> when its directory appeared
        self.committed: dict[str, float] = {}  # checkpoint -> when its MANIFEST.json appeared
        self.peak_rss, self.done = 0, threading.Event()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        threading.Thread(target=self._read, name="run-lines", daemon=True).start()
        threading.Thread(target=self._watch, name="run-watch", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout or ():  # opened with PIPE: never None
            line = line.rstrip("\n")
            self.lines.append((time.time(), line))
            match = STEP.match(line)
            if match:
                self.steps.setdefault(int(match[1]), []).append((float(match[2]), float(match[3])))
        self.done.set()

    def _watch(self) -> None:
        while not self.done.wait(0.02):
            now = time.time()
            for name in os.listdir(self.checkpoint_dir) if self.checkpoint_dir.is_dir() else ():
                if name.startswith("ckpt-"):
                    self.seen.setdefault(name, now)
                    if name not in self.committed and (self.checkpoint_dir / name / "MANIFEST.json").exists():
                        self.committed[name] = now
            if int(now * 4) != int((now - 0.02) * 4):  # memory every 0.25 s
                self.peak_rss = max(self.peak_rss, tree_rss(self.proc.pid))

    def wait_line(self, pattern: str, after: float, timeout: float) -> tuple[float, str]:
        """The first line matching `pattern` that arrived after `after` (unix time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                if at > after and re.search(pattern, line):
                    return at, line
            if self.done.is_set():
                break
            time.sleep(0.05)
        raise SystemExit(f"no line {pattern!r} (waited {timeout:.0f}s at most); the run's last lines:\n" + self.tail())

    def wait_commit(self, after: float, timeout: float) -> tuple[str, float]:
        """The first checkpoint committed after `after`: its name and when."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.done.is_set():
            fresh = [(at, name) for name, at in self.committed.items() if at > after]
            if fresh:
                at, name = min(fresh)
                return name, at
            time.sleep(0.05)
        raise SystemExit(f"no checkpoint committed within {timeout:.0f}s; the run's last lines:\n" + self.tail())

    def wait_steps_after(self, moment: float, timeout: float) -> None:
        """Until every worker printed a step that ended after `moment` (a step's line comes at its end)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.done.is_set():
            steps = list(self.steps.values())
            if steps and all(worker[-1][0] > moment for worker in steps):
                return
            time.sleep(0.05)
        raise SystemExit(f"not every worker trained on within {timeout:.0f}s; the run's last lines:\n" + self.tail())

    def tail(self, count: int = 40) -> str:
        return "\n".join(line for _, line in self.lines[-count:])

    def stop(self) -> None:
        """Kill the launcher and every node it started (each runs in a session of its own), by PID."""
        if self.proc.poll() is not None:
            return
        try:
            nodes = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            nodes = []
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(60)
        for node in nodes:
            try:
                node.kill()
            except psutil.Error:
                pass  # gone already (a node dies with its launcher)


def tree_rss(pid: int) -> int:
    """The summed RSS of process `pid` and its descendants (bytes)."""
    try:
        root = psutil.Process(pid)
        total = 0
        for proc in [root, *root.children(recursive=True)]:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                pass  # exited meanwhile
        return total
    except psutil.Error:
        return 0


def steps_in(run: Run, start: float, end: float) -> dict[int, float]:
    """Each worker's longest step whose time overlaps [start, end]."""
    longest = {}
    for worker, steps in run.steps.items():
        overlapping = [s for t, s in steps[WARMUP_STEPS:] if t > start and t - s < end]
        if overlapping:
            longest[worker] = round(max(overlapping), 3)
    return longest


def steady(run: Run, windows: list[tuple[float, float]]) -> dict:
    """Step time percentiles outside every window."""
    times = [
        s
        for steps in run.steps.values()
        for t, s in steps[WARMUP_STEPS:]
        if not any(t > a and t - s < b for a, b in windows)
    ]
    if not times:
        return {"steps": 0}
    return {
        "steps": len(times),
        "p50_ms": round(float(np.percentile(times, 50)) * 1e3, 1),
        "p99_ms": round(float(np.percentile(times, 99)) * 1e3, 1),
        "max_ms": round(max(times) * 1e3, 1),
    }


def checkpoint(run: Run, work: Path, number: int, args) -> tuple[dict, tuple[float, float]]:
    """Have the chief ask for checkpoint `number`, wait for its commit; its figures and window."""
    asked = time.time()
    (work / f"trigger{number}").touch()
    name, committed = run.wait_commit(asked, args.wait_s)
    run.wait_steps_after(committed, args.wait_s)
    longest = steps_in(run, asked, committed)
    figures: dict = {
        "name": name,
        "step_max_s": max(longest.values(), default=None),
        "step_max_s_by_worker": longest,
        "window_s": round(committed - asked, 2),
        "files_from_s": round(run.seen[name] - asked, 2) if name in run.seen else None,
        "bytes": manifest_bytes(run.checkpoint_dir / name),
    }
    figures.update(trained_in(run, asked, committed), write_s=logged_write_s(run, name))
    shards = [m for _, text in run.lines if (m := SHARD_WROTE.search(text)) and m[1] == name]
    figures["shard_write_s"] = {m[2]: float(m[4]) for m in shards}
    figures["kept_aside_bytes"] = {m[2]: int(m[5]) for m in shards}
    return figures, (asked, committed)


def trained_in(run: Run, start: float, end: float) -> dict:
    """The steps the workers finished within [start, end] and their median time: training during a write."""
    inside = [s for steps in run.steps.values() for t, s in steps[WARMUP_STEPS:] if start < t <= end]
    median = round(float(np.percentile(inside, 50)) * 1e3, 1) if inside else None
    return {"steps_in_window": len(inside), "step_p50_ms_in_window": median}


def logged_write_s(run: Run, name: str) -> float | None:
    """The chief's own seconds for checkpoint `name` ("committed ... in X s"; None if it logs no such line)."""
    deadline = time.monotonic() + 10  # the line follows the manifest's write
    while time.monotonic() < deadline:
        for _, line in list(run.lines):
            match = COMMITTED.search(line)
            if match and match[1] == name:
                return float(match[3])
        time.sleep(0.05)
    return None


def manifest_bytes(directory: Path) -> int:
    return sum(int(entry["bytes"]) for entry in json.loads((directory / "MANIFEST.json").read_text())["shards"])


def restore(run: Run, args) -> tuple[dict, tuple[float, float]]:
    """Kill -9 ps1 and wait until every worker trained a step after it came back; figures and window."""
    victim = next(c for c in psutil.Process(run.proc.pid).children() if "--role ps --index 1" in " ".join(c.cmdline()))
    killed = time.time()
    victim.kill()
    back: dict[int, tuple[float, float, str]] = {}  # worker -> (its line's arrival, its wait, restored from)
    deadline = time.monotonic() + args.wait_s
    while len(back) < args.workers:
        if time.monotonic() > deadline or run.done.is_set():
            raise SystemExit(f"not every worker got ps 1 back within {args.wait_s:.0f}s:\n{run.tail()}")
        for at, line in list(run.lines):
            if at > killed and (match := BACK.search(line)):
                back.setdefault(int(match[1]), (at, float(match[3]), match[2]))
        time.sleep(0.05)
    end = max(at for at, _, _ in back.values())
    run.wait_steps_after(end, args.wait_s)
    first_after = [min(t for t, _ in run.steps[w] if t > back[w][0]) for w in back]
    longest = steps_in(run, killed, end)
    return {
        **ps_restore(run, killed),
        "step_max_s": max(longest.values(), default=None),
        "step_max_s_by_worker": longest,
        "restore_s": round(max(first_after) - killed, 2),
        "worker_wait_s": {w: wait for w, (_, wait, _) in sorted(back.items())},
        "restored_from": sorted({name for _, _, name in back.values()}),
    }, (killed, max(first_after))


def ps_restore(run: Run, killed: float) -> dict:
    """What the restarted ps1 logged, in seconds after the kill (when its lines arrived): serving
    (process started, its checkpoint chosen and checked), its rows restored (at the first worker's
    registration); and its own seconds choosing the checkpoint."""
    figures: dict = {}
    for at, line in run.lines:
        if at <= killed:
            continue
        if "ps_serving_s" not in figures and re.search(PS1_SERVING, line):
            figures["ps_serving_s"] = round(at - killed, 2)
        if "ps_source_s" not in figures and (match := PS1_SOURCE.search(line)):
            figures["ps_source_s"] = float(match[1])
        if "ps_rows_restored_s" not in figures and (match := PS1_ROWS.search(line)):
            figures.update(ps_rows_restored_s=round(at - killed, 2), ps_rows=int(match[1]))
    return figures


def measure(run: Run, work: Path, args) -> dict:
    run.wait_line(r"\[worker0\] STEP 0 1 ", 0, args.wait_s)
    fills = [float(line.split()[-1]) for _, line in run.lines if " FILLED " in line]
    result: dict = {"fill_s": max(fills, default=None)}
    time.sleep(args.settle_s)
    windows = []
    result["checkpoints"] = []
    for number in range(1, args.deltas + 2):
        figures, window = checkpoint(run, work, number, args)
        result["checkpoints"].append(figures)
        windows.append(window)
        time.sleep(args.settle_s)
    if args.restore:
        result["restore"], window = restore(run, args)
        windows.append(window)
        time.sleep(args.settle_s)
    result["steady"] = steady(run, windows)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1024, help="examples a step (16 Zipf ids each)")
    parser.add_argument("--settle-s", type=float, default=15.0, help="steady training before and after each phase")
    parser.add_argument("--deltas", type=int, default=1, help="checkpoints after the first (each a delta)")
    parser.add_argument(
        "--restore",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="kill ps1 and time its partial recovery (default: on)",
    )
    parser.add_argument("--wait-s", type=float, default=600.0, help="longest wait for any one phase")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--log", help="write the run's lines to this file")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally below cleans up
    with tempfile.TemporaryDirectory(prefix="checkpoint-pause-", dir=args.workdir) as tmp:
        work = Path(tmp)
        argv = [
            sys.executable, "-m", "paramserver", "run", "--ps", "2", "--workers", str(args.workers),
            "--progress-every", "0", "--checkpoint-dir", str(work / "ckpt"), "--checkpoint-base-every", "8",
            "--recovery", "partial", "--rpc-timeout", "300", WORKER, "--",
            "--rows", str(args.rows), "--batch", str(args.batch), "--stop", str(work / "stop"),
            "--trigger", str(work / "trigger"),
        ]  # fmt: skip
        run = Run(argv, work / "ckpt")
        try:
            result = measure(run, work, args)
            (work / "stop").touch()
            if run.proc.wait(args.wait_s) != 0:
                raise SystemExit(f"the run exited with {run.proc.returncode}:\n{run.tail()}")
        finally:
            run.stop()
            if args.log:
                Path(args.log).write_text("".join(f"{at:.3f} {line}\n" for at, line in run.lines))
    result = {
        "bench": "checkpoint_pause",
        "rows": args.rows,
        "ps": 2,
        "workers": args.workers,
        "ids_per_step": args.batch * 16,
        **result,
        "peak_rss_mb": round(run.peak_rss / 2**20),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
