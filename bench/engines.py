"""Throughput of one training under each engine, back to back: `paramserver run`, Ray and Slurm.

The CTR example (examples/ctr.py, async, one torch thread per worker, a checkpoint directory of its own per
run, so the final checkpoint everywhere) on synthetic Criteo data (examples/ctr_data.py), at each shape
(`--shapes`, default 1 PS x 2 workers), under three engines:
- local: `paramserver run` (the local launcher; every node on 127.0.0.1);
- ray: `paramserver run --engine ray --address ADDR` (paramserver.ray.run) on a Ray cluster this bench starts:
  a head and two worker nodes on 127.0.0.1, 2 CPUs each (bench/engines_clusters.py);
- slurm: the sbatch script `paramserver slurm --nodes 2` writes, submitted to a two-node Slurm cluster this
  bench starts (tests/engines/slurm_cluster.sh, each node a network namespace: the job's traffic crosses a
  bridge). Needs root; skipped, saying why, without it.
The engines run in alternation, `--rounds` times (local, ray, slurm, local, ...): this machine's speed drifts
by tens of percent within minutes. The clusters start once, before the first round, and stay up to the end.

Per run: `examples_per_s` once training runs, as `paramserver run` counts it (examples after the first
progress line over the time from it to the latest step: the closing JSON line under local and Ray; under
Slurm, from the same progress lines, which the tasks write to files, fed to the same ProgressBoard);
`window_examples_per_s` (a check, from the logs alike for every engine: all examples over the time from the
first worker's "parameters registered" line, just before its first step, to the last "finished its data");
`startup_s` (submit, that is the launcher's start or sbatch, to that first "registered" line); `wall_s`
(submit to the launcher's exit or the job seen ended); `cores_in_training` (CPU seconds per second in that
window of: the nodes, the launcher or Ray driver, the Slurm daemons and job steps, the Ray cluster, the rest
of the machine; `engine_parts_cores` splits the engines' by process); `examples_per_node_cpu_s` (examples
per CPU second of the nodes: what the engine costs their own work, whatever other jobs took); `ratio` and
`node_cpu_ratio` (examples_per_s and examples_per_node_cpu_s over the same round's local run's). One JSON
line per run, per cluster start-up, then a summary line: each engine's median ratios, start-up and wall time.
Every process, namespace and temporary file it made is removed at the end, also on Ctrl-C or SIGTERM.

    python bench/engines.py [--rows 150000] [--epochs 4] [--rounds 2] [--engines local,ray,slurm] \\
        [--shapes 1x2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import psutil
from engines_clusters import RayLab, SlurmLab, stop_process

from paramserver.worker.progress import ProgressBoard

ROOT = Path(__file__).resolve().parents[1]
CTR = str(ROOT / "examples" / "ctr.py")
CTR_DATA = str(ROOT / "examples" / "ctr_data.py")
ENGINES = ("local", "ray", "slurm")
STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
REGISTERED = re.compile(STAMP + r" \w+ \S+: opt\d+: \d+ parameters registered")
FINISHED = re.compile(STAMP + r" \w+ \S+: worker (\d+) finished its data after (\d+) steps")
AUC = re.compile(r"held-out AUC (\d\.\d+)")
Shape = tuple[int, int]  # (PS, workers)


class CpuAccount(threading.Thread):
    """CPU seconds used while a run goes on, sampled every `interval` seconds, by group: `groups()` gives each
    group's root PIDs ({"launcher": [...], "slurm_cluster": [...], "ray_cluster": [...]}); a process counts
    in the first group whose roots it descends from, except the run's nodes (`paramserver node` processes),
    which count as "nodes"; "rest" is the machine's busy CPU time less all of them (other jobs, this bench's
    own sampling); "GROUP/NAME" keys split a group by process name. `between(t0, t1)` gives the seconds in
    that span (at the first samples at or after t0 and t1). Started and stopped by one thread; a process's
    CPU after its last sample is not counted."""

    def __init__(self, groups, interval: float = 1.0) -> None:
        super().__init__(name="cpu-account", daemon=True)
        self.groups, self.interval = groups, interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._used: dict[tuple[int, float], tuple[str, str, float]] = {}  # (pid, created) -> (group, name, cpu s)
        self._before: dict[tuple[int, float], float] = {}  # cpu seconds of the processes older than the account
        self._busy0 = _busy()
        self._halt = threading.Event()
        self._sample(first=True)

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self._sample()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)
        self._sample()

    def between(self, t0: float, t1: float) -> dict[str, float]:
        first, last = self._at(t0), self._at(t1)
        return {group: round(last[group] - first.get(group, 0.0), 2) for group in last}

    def _at(self, t: float) -> dict[str, float]:
        return next((totals for when, totals in self.samples if when >= t), self.samples[-1][1])

    def _sample(self, first: bool = False) -> None:
        for group, process in self._ours():
            try:
                with process.oneshot():
                    key, times, cmdline = (process.pid, process.create_time()), process.cpu_times(), process.cmdline()
            except psutil.Error:
                continue
            used = times.user + times.system
            if first:
                self._before[key] = used
            # once a node, always one: an exiting process's cmdline reads empty, a forked one's is its parent's
            is_node = self._used.get(key, ("",))[0] == "nodes" or (
                "node" in cmdline and any("paramserver" in part for part in cmdline)
            )
            name = "paramserver node" if is_node else process.name()
            self._used[key] = ("nodes" if is_node else group, name, used - self._before.get(key, 0.0))
        totals = {group: 0.0 for group in ("nodes", *self.groups())}
        for group, name, used in self._used.values():
            totals[group] = totals.get(group, 0.0) + used
            totals[f"{group}/{name}"] = totals.get(f"{group}/{name}", 0.0) + used  # the groups' parts, by name
        totals["rest"] = _busy() - self._busy0 - sum(v for k, v in totals.items() if "/" not in k)
        self.samples.append((time.time(), totals))

    def _ours(self) -> list[tuple[str, psutil.Process]]:
        found: dict[int, tuple[str, psutil.Process]] = {}
        for group, roots in reversed(list(self.groups().items())):  # the first group wins: it is set last
            for pid in roots:
                try:
                    root = psutil.Process(pid)
                    found.update((p.pid, (group, p)) for p in [root, *root.children(recursive=True)])
                except psutil.Error:
                    continue
        found.pop(os.getpid(), None)  # the bench itself: its sampling is in "rest"
        return list(found.values())


def _busy() -> float:
    machine = psutil.cpu_times()
    return machine.user + machine.nice + machine.system + machine.irq + machine.softirq + machine.steal


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def make_data(folder: Path, rows: int, vocab: int, epochs: int) -> list[str]:
    """Training and test files in Criteo's format, and the CTR example's arguments to read them."""
    paths = {}
    for name, count, seed in (("train", rows, 1), ("test", max(2_000, rows // 30), 2)):
        paths[name] = folder / f"{name}.tsv"
        argv = [sys.executable, CTR_DATA, "--rows", str(count), "--vocab", str(vocab), "--seed", str(seed)]
        subprocess.run([*argv, "--out", str(paths[name])], check=True, timeout=600)
    files = ["--train", str(paths["train"]), "--test", str(paths["test"])]
    return [*files, "--epochs", str(epochs), "--table-rows", str(2 * vocab)]


def stamp(text: str) -> float:
    """A log line's time (logging's local-time asctime) as unix time."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def figures(engine: str, text: str, submitted: float, ended: float, examples: int, examples_per_s: float) -> dict:
    """The figures every engine's run gives, from its output (the nodes' log lines) and its times."""
    registered = [stamp(m[1]) for m in REGISTERED.finditer(text)]
    finished = [stamp(m[1]) for m in FINISHED.finditer(text)]
    auc = AUC.search(text)
    record: dict = {"engine": engine, "examples": examples, "examples_per_s": round(examples_per_s, 1)}
    if registered and finished:
        first, last = min(registered), max(finished)
        record["window_examples_per_s"] = round(examples / (last - first), 1)
        record["startup_s"] = round(first - submitted, 2)
        record["train_s"] = round(last - first, 2)
        record["_window"] = (first, last)
    record["wall_s"] = round(ended - submitted, 2)
    record["test_auc"] = float(auc[1]) if auc else None
    return record


def run_launcher(argv: list[str], folder: Path, pids: list[int], timeout: float) -> tuple[int, str, float, float]:
    """Run `paramserver run ...` to its end (its PID added to `pids` once started): exit code, output, unix
    times of its start and of its exit."""
    output = folder / "out.txt"
    with output.open("w") as sink:
        submitted = time.time()
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        pids.append(proc.pid)
        try:
            code = proc.wait(timeout)
        finally:
            stop_process(proc)  # on a timeout, or Ctrl-C meanwhile
        ended = time.time()
    return code, output.read_text(errors="replace"), submitted, ended


def closing_line(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}


def measure_launcher(engine: str, shape: Shape, ctr: list[str], folder: Path, address: str, pids: list[int]) -> dict:
    ps, workers = shape
    argv = [sys.executable, "-m", "paramserver", "run", "--ps", str(ps), "--workers", str(workers)]
    argv += ["--torch-threads", "1", "--checkpoint-dir", str(folder / "ckpt")]
    if engine == "ray":
        argv += ["--engine", "ray", "--address", address]
    code, text, submitted, ended = run_launcher([*argv, CTR, "--", *ctr], folder, pids, timeout=900)
    summary = closing_line(text)
    record = figures(engine, text, submitted, ended, summary.get("examples", 0), summary.get("examples_per_s", 0.0))
    return {**record, "exit": code, "launcher_wall_s": summary.get("wall_s")}


def measure_slurm(shape: Shape, ctr: list[str], folder: Path, slurm: SlurmLab) -> dict:
    ps, workers = shape
    script = folder / "job.sh"
    write = [sys.executable, "-m", "paramserver", "slurm", "--ps", str(ps), "--workers", str(workers)]
    write += ["--nodes", "2", "--python", slurm.python, "--checkpoint-dir", str(folder / "ckpt")]
    write += ["--name", "engines-bench", "-o", str(script), CTR, "--", *ctr]
    subprocess.run(write, check=True, timeout=60, cwd=ROOT)
    job = slurm.submit(script)
    try:
        state, ended = slurm.wait(job, timeout=900)
    finally:
        slurm.cancel(job)  # nothing left if it ended; stopped if this was interrupted
    text = job.output.read_text(errors="replace") if job.output.exists() else ""
    board = ProgressBoard()
    for line in progress_lines(job.progress):
        board.feed(line)
    totals = board.totals()
    record = figures("slurm", text, job.submitted, ended, totals["examples"], totals["examples_per_s"])
    return {**record, "exit": 0 if state == "COMPLETED" else state, "job": job.job_id}


def progress_lines(folder: Path) -> list[str]:
    """Every task's progress lines in the order of their steps' times (as a launcher's pipe would deliver
    them), a line without a time (done, a result) right after its worker's previous one."""
    timed = []
    for path in sorted(folder.glob("task-*.jsonl")):
        t = 0.0
        for index, line in enumerate(path.read_text().splitlines()):
            try:
                t = float(json.loads(line).get("t", t))
            except (ValueError, AttributeError):
                continue
            timed.append((t, path.name, index, line))
    return [line for *_, line in sorted(timed)]


def measure(engine: str, shape: Shape, ctr: list[str], folder: Path, ray: RayLab, slurm: SlurmLab | None) -> dict:
    """One run under `engine`, with the cores each group of processes kept busy while it trained."""
    launcher: list[int] = []
    account = CpuAccount(
        lambda: {"launcher": launcher, "slurm_cluster": slurm.pids() if slurm else [], "ray_cluster": [os.getpid()]}
    )
    account.start()
    try:
        if engine == "slurm" and slurm is not None:
            record = measure_slurm(shape, ctr, folder, slurm)
        else:
            record = measure_launcher(engine, shape, ctr, folder, ray.address, launcher)
    finally:
        account.stop()
    window = record.pop("_window", None)
    if window:
        cores = {group: used / (window[1] - window[0]) for group, used in account.between(*window).items()}
        record["cores_in_training"] = {group: round(v, 2) for group, v in cores.items() if "/" not in group}
        if cores.get("nodes"):  # what the engine costs the nodes' own work, whatever CPU other jobs took
            record["examples_per_node_cpu_s"] = round(record["window_examples_per_s"] / cores["nodes"], 1)
        parts = {part: round(v, 2) for part, v in cores.items() if "/" in part and not part.startswith("nodes/")}
        record["engine_parts_cores"] = {
            part: v for part, v in sorted(parts.items(), key=lambda kv: -kv[1]) if v >= 0.02
        }
    return record


def shape_of(text: str) -> list[Shape]:
    shapes = []
    for item in text.split(","):
        ps, _, workers = item.partition("x")
        shapes.append((int(ps), int(workers)))
    return shapes


def add_ratios(record: dict, local: dict) -> None:
    """The run's figures over the same round's local run's: examples/s, and examples per node CPU second."""
    record["ratio"] = round(record["examples_per_s"] / local["examples_per_s"], 3)
    if record.get("examples_per_node_cpu_s") and local.get("examples_per_node_cpu_s"):
        record["node_cpu_ratio"] = round(record["examples_per_node_cpu_s"] / local["examples_per_node_cpu_s"], 3)


def summarize(runs: list[dict], clusters: dict) -> dict:
    summary: dict = {"summary": True, **clusters}
    for engine in ENGINES:
        mine = [r for r in runs if r["engine"] == engine and r.get("exit") == 0]
        if not mine:
            continue
        ratios = [r["ratio"] for r in mine if r.get("ratio")]
        per_cpu = [r["node_cpu_ratio"] for r in mine if r.get("node_cpu_ratio")]
        summary[engine] = {
            "runs": len(mine),
            "examples_per_s_median": statistics.median(r["examples_per_s"] for r in mine),
            "ratio_median": round(statistics.median(ratios), 3) if ratios else None,
            "node_cpu_ratio_median": round(statistics.median(per_cpu), 3) if per_cpu else None,
            "startup_s_median": statistics.median(r.get("startup_s", 0.0) for r in mine),
            "wall_s_median": statistics.median(r["wall_s"] for r in mine),
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=150_000, help="training rows (the test file: a 30th)")
    parser.add_argument("--epochs", type=int, default=4, help="passes over the training rows")
    parser.add_argument("--vocab", type=int, default=100_000, help="distinct ids of the largest features")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--shapes", type=shape_of, default=[(1, 2)], help="PSxWORKERS, comma-separated")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}: choose among {ENGINES}")
    if "slurm" in engines and os.geteuid() != 0:
        emit({"engine": "slurm", "skipped": "the Slurm cluster needs root (network namespaces, slurmd); not root"})
        engines.remove("slurm")
    folder = Path(tempfile.mkdtemp(prefix="engines-bench-"))
    folder.chmod(0o755)  # the Slurm tasks (root too, in namespaces) read the data and write checkpoints here
    ray, slurm = RayLab(), SlurmLab() if "slurm" in engines else None
    try:
        ctr = make_data(folder, args.rows, args.vocab, args.epochs)
        clusters = {}
        if "ray" in engines:
            clusters["ray_cluster_start_s"] = round(ray.start().started_s, 2)
            emit({"cluster": "ray", "nodes": 3, "start_s": clusters["ray_cluster_start_s"]})
        if slurm is not None:
            clusters["slurm_cluster_start_s"] = round(slurm.start(sys.executable).started_s, 2)
            emit({"cluster": "slurm", "nodes": 2, "start_s": clusters["slurm_cluster_start_s"]})
        # after the Ray cluster's start, which sets a SIGTERM handler of its own; Ctrl-C even when started in
        # the background (which ignores SIGINT): the finally below cleans up
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        runs = []
        for shape in args.shapes:
            for round_ in range(args.rounds):
                local: dict | None = None
                for engine in engines:
                    run_dir = folder / f"{engine}-{shape[0]}x{shape[1]}-{round_}"
                    run_dir.mkdir()
                    load = os.getloadavg()[0]
                    record = measure(engine, shape, ctr, run_dir, ray, slurm)
                    record = {"round": round_, "ps": shape[0], "workers": shape[1], **record, "load1": round(load, 2)}
                    if engine == "local":
                        local = record if record.get("exit") == 0 else None
                    if local is not None:
                        add_ratios(record, local)
                    emit(record)
                    runs.append(record)
                    shutil.rmtree(run_dir, ignore_errors=True)
        emit(summarize(runs, clusters))
    except KeyboardInterrupt:
        emit({"interrupted": True})
        raise SystemExit(130) from None
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the clean-up runs to its end
        try:
            ray.stop()
        finally:
            if slurm is not None:
                slurm.stop()
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
