"""Elastic runs: examples/s as workers join and leave a running job, and how long a join and a leave take.

One `paramserver run --ps 1 --workers 1 --max-workers 4` (async) of bench/elastic_worker.py: real
PS and worker processes over gRPC, a small linear model on data the coordinator hands out
(paramserver.Splits, far more than the bench trains), each step followed by `--pace` seconds of
sleep so that the worker count, not the machine's two cores, sets the speed. This process drives
the phases with the real CLI, `paramserver scale <launcher pid> N` (default 1, 2, 4, 2, 1 workers).
A phase begins with its scale command; once the change has happened (every new worker trained a
step, every worker asked to leave exited) it trains `--phase-s` seconds as it is, then the next
phase begins. At the end the workers see the file `--stop` and the run ends by itself (killed, with
every node by PID, if it does not; the temporary directory is removed).

examples/s come from the workers' own lines ("STEP <worker> <examples> <unix time>", one per
step): the examples of the steps that ended in the phase's steady part, over its length
(`examples_per_s`), and over the whole phase, change included (`examples_per_s_whole`). The
launcher's progress lines in the steady part give `progress_examples_per_s` (their mean), a check.
From the scale command's start: `scale_cli_s` (the command's own run), `noticed_s` (the launcher's
"scaling to" line: it reads the wish about once a second), for each worker started `running_s` (its
node's "running <script>" line: the process started and imported paramserver), `imported_s` (the
script's "IMPORTED": torch and the script's imports done), `joined_s` (the coordinator's "worker N
joined": ps.init registered it) and `join_s` (its first step's end); for each worker asked to leave
`last_step_s` (its last step's end) and `leave_s` (the launcher's "left the run": its process
exited). `join_s` and `leave_s` of a phase are the slowest of its workers'. One JSON line per
phase, then a summary line with each phase's examples/s over the first's.

    python bench/elastic.py [--phases 1,2,4,2,1] [--phase-s 12] [--pace 0.04] [--batch 64]
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "bench" / "elastic_worker.py")
STEP = re.compile(r"^\[worker(\d+)\] STEP \d+ (\d+) ([\d.]+)$")
SCALING = re.compile(r"^\[run\] .*scaling to (\d+) workers: started \[([\d, ]*)\], asked to leave \[([\d, ]*)\]")
PROGRESS = re.compile(r"^\[run\] .*examples/s=([\d,]+) ")
MAX_WORKERS = 4
WARMUP_STEPS = 10  # the first worker's first steps (registration, first replies) count in no figure


class Run:
    """One `paramserver run`: its lines (with the time each arrived) and the workers' steps."""

    def __init__(self, argv: list[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.steps: list[tuple[int, int, float]] = []  # (worker, examples, unix time at the step's end)
        self.done = threading.Event()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        threading.Thread(target=self._read, name="run-lines", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout or ():  # opened with PIPE: never None
            line = line.rstrip("\n")
            match = STEP.match(line)
            if match:
                self.steps.append((int(match[1]), int(match[2]), float(match[3])))
            else:
                self.lines.append((time.time(), line))
        self.done.set()

    def wait_for(self, found, what: str, timeout: float):
        """Poll `found()` until it gives something other than None; SystemExit (with the run's last
        lines) after `timeout` seconds or when the run ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.done.is_set():
            result = found()
            if result is not None:
                return result
            time.sleep(0.05)
        raise SystemExit(f"no {what} within {timeout:.0f}s; the run's last lines:\n{self.tail()}")

    def line_after(self, pattern: str | re.Pattern, after: float) -> tuple[float, re.Match] | None:
        """The first line matching `pattern` that arrived after `after` (unix time), and its match."""
        for at, line in list(self.lines):
            if at > after and (match := re.search(pattern, line)):
                return at, match
        return None

    def steps_of(self, worker: int, after: float) -> list[float]:
        """The end times of `worker`'s steps that ended after `after`."""
        return [t for w, _, t in list(self.steps) if w == worker and t > after]

    def tail(self, count: int = 30) -> str:
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


def scale(run: Run, workers: int) -> tuple[float, float]:
    """`paramserver scale <launcher pid> N`, as a user types it: when it was called, and its seconds."""
    called = time.time()
    argv = [sys.executable, "-m", "paramserver", "scale", str(run.proc.pid), str(workers)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv[1:])} exited with {done.returncode}: {done.stderr.strip()}")
    return called, time.time() - called


def slots(text: str) -> list[int]:
    return [int(slot) for slot in text.split(",") if slot.strip()]


def change(run: Run, called: float, wait_s: float) -> tuple[dict, float]:
    """Wait for the change the scale command asked for; its timings (seconds after `called`) and
    the moment it was complete (the last new worker's first step, the last leaver's exit)."""
    noticed, match = run.wait_for(lambda: run.line_after(SCALING, called), "scaling line", wait_s)
    started, leaving = slots(match[2]), slots(match[3])
    figures: dict = {"noticed_s": round(noticed - called, 2), "started": started, "asked_to_leave": leaving}
    complete = noticed
    if started:
        joins, complete = joined(run, started, called, wait_s)
        figures.update(joins)
    if leaving:
        leaves, left_at = left(run, leaving, called, wait_s)
        figures.update(leaves)
        complete = max(complete, left_at)
    return figures, complete


def joined(run: Run, started: list[int], called: float, wait_s: float) -> tuple[dict, float]:
    """Each started worker's start-up, seconds after `called`; the last one's first step (unix time)."""
    running, imported, registered, first_step = {}, {}, {}, {}
    for slot in started:
        at, _ = run.wait_for(
            lambda s=slot: run.line_after(rf"^\[worker{s}\] .*worker {s}: running", called),
            f"worker {slot} start",
            wait_s,
        )
        running[slot] = round(at - called, 2)
        _, match = run.wait_for(
            lambda s=slot: run.line_after(rf"^\[worker{s}\] IMPORTED ([\d.]+)$", called),
            f"worker {slot} imports",
            wait_s,
        )
        imported[slot] = round(float(match[1]) - called, 2)
        at, _ = run.wait_for(
            lambda s=slot: run.line_after(rf"coordinator: worker {s} joined", called), f"worker {slot} join", wait_s
        )
        registered[slot] = round(at - called, 2)
        first = run.wait_for(lambda s=slot: next(iter(run.steps_of(s, called)), None), f"worker {slot} step", wait_s)
        first_step[slot] = first
    figures = {
        "running_s": running,
        "imported_s": imported,
        "joined_s": registered,
        "join_s_by_worker": {slot: round(t - called, 2) for slot, t in first_step.items()},
        "join_s": round(max(first_step.values()) - called, 2),
    }
    return figures, max(first_step.values())


def left(run: Run, leaving: list[int], called: float, wait_s: float) -> tuple[dict, float]:
    """Each leaver's last step and exit, seconds after `called`; the last exit (unix time)."""
    exited, last_step = {}, {}
    for slot in leaving:
        at, _ = run.wait_for(
            lambda s=slot: run.line_after(rf"^\[run\] worker{s} left the run", called), f"worker {slot} leave", wait_s
        )
        exited[slot] = at
        last_step[slot] = round(max(run.steps_of(slot, called), default=called) - called, 2)
    figures = {
        "last_step_s": last_step,
        "leave_s_by_worker": {slot: round(t - called, 2) for slot, t in exited.items()},
        "leave_s": round(max(exited.values()) - called, 2),
    }
    return figures, max(exited.values())


def rates(run: Run, start: float, end: float) -> dict:
    """examples/s of the steps that ended in (start, end], in all and by worker; the progress lines' mean."""
    inside = [(w, n) for w, n, t in list(run.steps) if start < t <= end]
    by_worker: dict[int, int] = {}
    for worker, examples in inside:
        by_worker[worker] = by_worker.get(worker, 0) + examples
    seconds = end - start
    progress = [
        float(m[1].replace(",", ""))
        for at, line in list(run.lines)
        if start < at <= end and (m := PROGRESS.search(line))
    ]
    return {
        "examples_per_s": round(sum(n for _, n in inside) / seconds, 1),
        "examples_per_s_by_worker": {w: round(n / seconds, 1) for w, n in sorted(by_worker.items())},
        "progress_examples_per_s": round(statistics.mean(progress), 1) if progress else None,
    }


def phases(run: Run, counts: list[int], args) -> list[dict]:
    """Drive the run through `counts` workers; each phase's figures."""
    run.wait_for(lambda: run.steps[WARMUP_STEPS] if len(run.steps) > WARMUP_STEPS else None, "first steps", args.wait_s)
    results = []
    for number, workers in enumerate(counts, 1):
        figures: dict = {}
        if number == 1:
            called = complete = time.time()
        else:
            called, cli_s = scale(run, workers)
            figures, complete = change(run, called, args.wait_s)
            figures["scale_cli_s"] = round(cli_s, 2)
        time.sleep(max(0.0, complete + args.phase_s - time.time()))
        end = time.time()
        steady = rates(run, complete, end)
        whole = rates(run, called, end)["examples_per_s"]
        result = {"bench": "elastic", "phase": number, "workers": workers, **steady}
        result.update(examples_per_s_whole=whole, phase_s=round(end - called, 2), steady_s=round(end - complete, 2))
        result.update(figures)
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


def summary(results: list[dict], args, load_before: float, wall_s: float) -> dict:
    first = results[0]["examples_per_s"]
    joins = [r["join_s"] for r in results if "join_s" in r]
    leaves = [r["leave_s"] for r in results if "leave_s" in r]
    return {
        "bench": "elastic",
        "summary": True,
        "workers": [r["workers"] for r in results],
        "examples_per_s": [r["examples_per_s"] for r in results],
        "ratio_to_1_worker": [round(r["examples_per_s"] / first, 2) for r in results],
        "pace_bound_per_worker_examples_per_s": round(args.batch / args.pace, 1),
        "join_s_max": max(joins, default=None),
        "leave_s_max": max(leaves, default=None),
        "pace_s": args.pace,
        "batch": args.batch,
        "load_1min_before": round(load_before, 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
        "wall_s": round(wall_s, 1),
    }


def counts_of(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",")]
    if counts[0] != 1 or not all(1 <= c <= MAX_WORKERS for c in counts):
        raise argparse.ArgumentTypeError(f"phases are worker counts from 1 to {MAX_WORKERS}, the first 1; got {text!r}")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", type=counts_of, default=[1, 2, 4, 2, 1], help="worker counts, the first 1")
    parser.add_argument("--phase-s", type=float, default=12.0, help="seconds each phase trains once its change is done")
    parser.add_argument("--pace", type=float, default=0.04, help="seconds of sleep in each step")
    parser.add_argument("--batch", type=int, default=64, help="examples a step")
    parser.add_argument("--wait-s", type=float, default=120.0, help="longest wait for any one change")
    parser.add_argument("--workdir", default=tempfile.gettempdir())
    parser.add_argument("--log", help="write the run's lines (steps excluded) to this file")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the finally below cleans up
    load_before, started = os.getloadavg()[0], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="elastic-", dir=args.workdir) as tmp:
        stop = Path(tmp) / "stop"
        argv = [
            sys.executable, "-m", "paramserver", "run", "--ps", "1", "--workers", "1",
            "--max-workers", str(MAX_WORKERS), "--progress-every", "1", WORKER, "--",
            "--pace", str(args.pace), "--batch", str(args.batch), "--stop", str(stop),
        ]  # fmt: skip
        run = Run(argv)
        try:
            results = phases(run, args.phases, args)
            stop.touch()
            if run.proc.wait(args.wait_s) != 0:
                raise SystemExit(f"the run exited with {run.proc.returncode}:\n{run.tail()}")
        finally:
            run.stop()
            if args.log:
                Path(args.log).write_text("".join(f"{at:.3f} {line}\n" for at, line in run.lines))
    print(json.dumps(summary(results, args, load_before, time.monotonic() - started)), flush=True)


if __name__ == "__main__":
    main()
