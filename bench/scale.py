"""Scale of one PS: throughput and memory with N rows, checkpoint, restore and export of N rows.

One JSON line per case and size (`"bench": "scale"`), printed as soon as it is measured. Every
PS is a real process (`python -m paramserver node --role ps`, plus `--ps-args`), reached through
the real clients (TableClient, PSClient) as a worker reaches it. Table "t": dim 16, Adagrad.

Cases (`--cases`, comma-separated; restore and export run on the checkpoint case's checkpoint,
which then runs too):

- throughput: fill the table to N rows by steps of 65,536 new ids (each step = a lookup of the
  ids, then a row push of their gradients riding a PushPull, as a worker's step sends them), then
  the same steps on 65,536 uniform ids over the N filled rows (no new row), then on 65,536
  Zipf(1.1) ids (ranks folded into [0, space-factor x N), so ids the table has never seen keep
  arriving and it grows), `--measure-s` each; each step takes the draws' distinct ids.
  `fill`: rows reached (`complete`: all N within the limit), wall seconds, rows/s, the longest
  step (`step_max_ms`, the longest pause a worker sees while the table grows, and the row
  count at which it came) with p50/p99. `uniform` / `zipf`: `rows_per_s` = distinct ids looked up
  and updated per second, `distinct_per_batch`, step p50/p99/max, `new_rows` the table gained.
  A phase that a PS limit stops (max rows, memory) reports what it reached and `stopped_by`.
  Rates use the summed step times (the client's making of ids is left out); every phase gives
  `ps_cpu_s_per_mrows` (the PS's utime+stime, /proc/PID/stat, per million rows) and
  `client_cpu_s_per_mrows` (this process). `memory` (after the fill): VmRSS, RssAnon, RssFile and
  VmHWM of the PS (/proc/PID/status), `bytes_per_row` = RSS growth from the registered empty
  table / rows, `table_bytes_per_row` as the table counts its own arrays. `peak_rss_mb_end`:
  VmHWM after the whole case.
- checkpoint: a PS with --checkpoint-dir filled fast (lookups of `--fill-batch` new ids, no
  push; half of `--limit-s` at most; 65,536 ids a lookup filled faster than 2^18 or 2^20 did),
  then a Checkpoint call (PSClient.checkpoint, what the chief does) and the manifest's commit.
  `checkpoint_s`, `commit_s`, the PS's RSS before and its peak during it (VmHWM reset by
  /proc/PID/clear_refs, and VmRSS sampled every 50 ms: the larger of the two), `file_bytes`
  (and per row), write MB/s, the PS's CPU seconds. `filled`: the memory of the PS that inserted
  the rows (as throughput's `memory`) and its fill's rate.
- restore: for each count in `--restore-ps` (a run each), that many PS with `--resume` on the
  checkpoint start together; one TableClient registers the table on all of them (num_shards =
  the count: each loads its share). `ready_s` (start to every ready line), `registered_s`
  (start to registered), each PS's rows, RSS, RssAnon, VmHWM and `bytes_per_row` (its RSS over a
  fresh PS's, per row it holds) and `vs_filled` (that, over the filled PS's bytes per row);
  `rows_total` must be N.
- export: `python -m paramserver checkpoint export DIR` then `... inspect DIR`: exit code,
  seconds, peak RSS (the child's ru_maxrss, from wait4), the .pt file's bytes, inspect's rows.

Each case stops a phase once `--limit-s` has passed and reports what it reached (or an
`error`). Everything lives in a temporary directory under `--workdir`, removed at the end
(Ctrl-C and SIGTERM included); every PS is stopped by its PID.

    python bench/scale.py [--cases throughput,checkpoint,restore,export] [--rows 5M,20M,50M]
        [--limit-s 900] [--measure-s 30] [--restore-ps 1,2,4] [--workdir /tmp]
        [--ps-args "--table-memory-budget 4GiB --spill-dir /tmp/spill"]
"""

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
from scale_parts import (
    PSProcess,
    RssSampler,
    Workdir,
    cpu_s,
    mb,
    memory,
    new_ids,
    percentile,
    ps_flags,
    reset_peak,
    run_measured,
    uniform_ids,
    zipf_ids,
)

from paramserver.base.consistency_spec import ConsistencySpec
from paramserver.base.errors import ParamServerError
from paramserver.checkpoint.store import CheckpointStore, checkpoint_name
from paramserver.client.ps_client import PSClient
from paramserver.client.table_client import TableClient

DIM, BATCH, TABLE = 16, 65536, "t"
ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.01}}
INIT = {"kind": "normal", "std": 0.01}
GRADS = (np.random.default_rng(1).standard_normal((BATCH, DIM)) * 0.01).astype(np.float32)


class Budget:
    """The time left to one case (`--limit-s`)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, reserve: float = 0.0) -> float:
        return self.end - reserve - time.monotonic()


def record(case: str, rows: int, args, **fields) -> dict:
    return {"bench": "scale", "case": case, "rows": rows, "dim": DIM, "ps_args": args.ps_args, **fields}


def connect(ps: PSProcess, timeout: float) -> tuple[TableClient, PSClient]:
    channel = ps.wait_ready(timeout)
    tables = TableClient([channel], max(timeout, 60))
    tables.register(TABLE, DIM, ADAGRAD, INIT)
    return tables, PSClient([channel], max(timeout, 60))


# ---- throughput -------------------------------------------------------------------------------
def step(tables: TableClient, client: PSClient, ids: np.ndarray) -> float:
    """One worker step on `ids`: a lookup, then a row push of their gradients; its seconds."""
    started = time.perf_counter()
    tables.lookup(TABLE, ids)
    riders = tables.riders()
    riders.push(TABLE, ids, GRADS[: ids.shape[0]])
    client.push_pull({}, [], riders=riders).wait(tables.rpc_timeout_s)
    return time.perf_counter() - started


class Meter:
    """Steps, rows and CPU of one phase: the PS's (by PID) and this process's."""

    def __init__(self, pid: int) -> None:
        self.pid, self.times, self.rows, self.at = pid, [], 0, []
        self.cpu, self.client_cpu, self.wall = cpu_s(pid), time.process_time(), time.perf_counter()

    def add(self, seconds: float, rows: int) -> None:
        self.times.append(seconds)
        self.at.append(self.rows)
        self.rows += rows

    def figures(self) -> dict:
        busy, per_m = sum(self.times) or 1e-9, max(self.rows, 1) / 1e6
        worst = int(np.argmax(self.times)) if self.times else 0
        return {
            "steps": len(self.times),
            "rows_per_s": round(self.rows / busy),
            "wall_s": round(time.perf_counter() - self.wall, 2),
            "step_p50_ms": round(percentile(self.times, 50) * 1e3, 1),
            "step_p99_ms": round(percentile(self.times, 99) * 1e3, 1),
            "step_max_ms": round(max(self.times, default=0) * 1e3, 1),
            "step_max_at_rows": self.at[worst] if self.times else 0,
            "ps_cpu_s_per_mrows": round((cpu_s(self.pid) - self.cpu) / per_m, 3),
            "client_cpu_s_per_mrows": round((time.process_time() - self.client_cpu) / per_m, 3),
        }


def fill_by_steps(tables, client, pid: int, rows: int, budget: Budget, reserve: float) -> dict:
    meter, stopped = Meter(pid), None
    while meter.rows < rows and budget.left(reserve) > 0:
        ids = new_ids(meter.rows, min(BATCH, rows - meter.rows))
        try:
            meter.add(step(tables, client, ids), ids.shape[0])
        except ParamServerError as exc:  # a limit of the PS (rows, memory): what was reached is the figure
            stopped = str(exc)
            break
    return {"rows": meter.rows, "complete": meter.rows == rows, **meter.figures(), **stopped_by(stopped)}


def stopped_by(error: str | None) -> dict:
    return {} if error is None else {"stopped_by": error[-1000:]}


def steady(tables, client, ps: PSProcess, make_ids, seconds: float, seed: int) -> dict:
    """Steps on the ids `make_ids(rng)` gives, for `seconds` (after one warm-up step)."""
    rng = np.random.default_rng(seed)
    if seconds <= 0:
        return {"skipped": "no time left"}
    before, meter, stopped = ps.rows(TABLE), None, None
    end = time.monotonic() + seconds
    try:
        step(tables, client, make_ids(rng))
        meter = Meter(ps.pid)
        while time.monotonic() < end:
            ids = make_ids(rng)
            meter.add(step(tables, client, ids), ids.shape[0])
    except ParamServerError as exc:  # as in fill_by_steps
        stopped = str(exc)
    figures = meter.figures() if meter is not None else {}
    figures.pop("step_max_at_rows", None)
    return {
        **figures,
        "distinct_per_batch": round(meter.rows / max(len(meter.times), 1)) if meter is not None else 0,
        "new_rows": ps.rows(TABLE) - before,
        **stopped_by(stopped),
    }


def memory_figures(ps: PSProcess, base: dict, rows: int) -> dict:
    now = memory(ps.pid)
    return {
        "baseline_rss_mb": mb(base["VmRSS"]),
        "rss_mb": mb(now["VmRSS"]),
        "rss_anon_mb": mb(now["RssAnon"]),
        "rss_file_mb": mb(now["RssFile"]),
        "peak_rss_mb": mb(now["VmHWM"]),
        "bytes_per_row": round((now["VmRSS"] - base["VmRSS"]) / max(rows, 1), 1),
        "table_bytes_per_row": round(ps.table_bytes(TABLE) / max(rows, 1), 1),
    }


def throughput(args, work: Workdir, rows: int) -> dict:
    budget, out = Budget(args.limit_s), record("throughput", rows, args, batch_ids=BATCH)
    ps = PSProcess(work.path, ps_flags(args.ps_args))
    try:
        tables, client = connect(ps, budget.left())
        base = memory(ps.pid)
        out["fill"] = fill_by_steps(tables, client, ps.pid, rows, budget, reserve=2 * args.measure_s)
        out["memory"] = memory_figures(ps, base, out["fill"]["rows"])
        filled, space = out["fill"]["rows"], args.space_factor * rows
        out["uniform"] = steady(
            tables,
            client,
            ps,
            lambda rng: uniform_ids(rng, BATCH, max(filled, 1)),
            min(args.measure_s, budget.left() / 2),
            args.seed,
        )
        out["zipf"] = steady(
            tables,
            client,
            ps,
            lambda rng: zipf_ids(rng, BATCH, space),
            min(args.measure_s, budget.left()),
            args.seed + 1,
        )
        out["zipf_space"] = space
        out["peak_rss_mb_end"] = mb(memory(ps.pid)["VmHWM"])
    finally:
        ps.stop()
    return out


# ---- checkpoint, restore, export --------------------------------------------------------------
def fill_fast(tables: TableClient, pid: int, rows: int, batch: int, budget: Budget, reserve: float) -> dict:
    started, cpu, filled, stopped = time.perf_counter(), cpu_s(pid), 0, None
    while filled < rows and budget.left(reserve) > 0:
        count = min(batch, rows - filled)
        try:
            tables.lookup(TABLE, new_ids(filled, count))
        except ParamServerError as exc:  # as in fill_by_steps
            stopped = str(exc)
            break
        filled += count
    took = time.perf_counter() - started
    return {
        "rows": filled,
        "complete": filled == rows,
        "fill_s": round(took, 2),
        "rows_per_s": round(filled / max(took, 1e-9)),
        "ps_cpu_s_per_mrows": round((cpu_s(pid) - cpu) / max(filled / 1e6, 1e-6), 3),
        **stopped_by(stopped),
    }


def write_checkpoint(client: PSClient, pid: int, directory: str, timeout: float) -> dict:
    """Checkpoint 1 of the PS (the chief's Checkpoint call), then its manifest; the figures."""
    name, hwm_reset, before, cpu = checkpoint_name(1), reset_peak(pid), memory(pid), cpu_s(pid)
    with RssSampler(pid) as sampler:
        started = time.perf_counter()
        entries = client.checkpoint(name, timeout)
        took = time.perf_counter() - started
        CheckpointStore(directory).commit(
            name, {"step": 1, "num_shards": len(entries), "shards": entries, "mode": ConsistencySpec().to_dict()}
        )
        committed = time.perf_counter() - started - took
    hwm = memory(pid)["VmHWM"] if hwm_reset else 0
    peak = max(sampler.peak, hwm)
    files = sum(path.stat().st_size for path in Path(directory, name).iterdir())
    return {
        "checkpoint_s": round(took, 2),
        "commit_s": round(committed, 3),
        "rss_before_mb": mb(before["VmRSS"]),
        "peak_rss_mb": mb(peak),
        "peak_over_before": round(peak / before["VmRSS"], 2),
        "sampled_peak_mb": mb(sampler.peak),
        "hwm_peak_mb": mb(hwm) if hwm_reset else None,
        "file_bytes": files,
        "write_mb_per_s": round(files / (1 << 20) / max(took, 1e-9), 1),
        "ps_cpu_s": round(cpu_s(pid) - cpu, 2),
    }


def checkpoint(args, work: Workdir, rows: int, directory: str) -> dict:
    budget = Budget(args.limit_s)
    ps = PSProcess(work.path, ps_flags(args.ps_args, directory))
    try:
        tables, client = connect(ps, budget.left())
        base = memory(ps.pid)
        fill = fill_fast(tables, ps.pid, rows, args.fill_batch, budget, reserve=args.limit_s / 2)  # half for the rest
        filled = {**memory_figures(ps, base, fill["rows"]), "fill": fill}
        written = write_checkpoint(client, ps.pid, directory, max(budget.left(), 60))
    finally:
        ps.stop()
    per_row = round(written["file_bytes"] / max(fill["rows"], 1), 1)
    return record("checkpoint", rows, args, **written, file_bytes_per_row=per_row, filled=filled)


def restore(args, work: Workdir, directory: str, count: int, filled: dict) -> dict:
    budget, rows = Budget(args.limit_s), filled["fill"]["rows"]
    procs = [PSProcess(work.path, ps_flags(args.ps_args, directory, resume=True), index=i) for i in range(count)]
    try:
        started = min(ps.started for ps in procs)
        channels = [ps.wait_ready(budget.left()) for ps in procs]
        ready = time.perf_counter() - started
        TableClient(channels, max(budget.left(), 60)).register(TABLE, DIM, ADAGRAD, INIT)
        registered = time.perf_counter() - started
        shards = [restored_shard(ps, filled) for ps in procs]
    finally:
        for ps in procs:
            ps.stop()
    total = sum(shard["rows"] for shard in shards)
    return record(
        "restore",
        rows,
        args,
        ps=count,
        ready_s=round(ready, 2),
        registered_s=round(registered, 2),
        rows_total=total,
        rows_match=total == rows,
        filled_rss_mb=filled["rss_mb"],
        shards=shards,
    )


def restored_shard(ps: PSProcess, filled: dict) -> dict:
    now, rows = memory(ps.pid), ps.rows(TABLE)
    per_row = (now["VmRSS"] - filled["baseline_rss_mb"] * (1 << 20)) / max(rows, 1)
    return {
        "ready_s": round(ps.ready_s, 2),
        "rows": rows,
        "rss_mb": mb(now["VmRSS"]),
        "rss_anon_mb": mb(now["RssAnon"]),
        "peak_rss_mb": mb(now["VmHWM"]),
        "bytes_per_row": round(per_row, 1),
        "vs_filled": round(per_row / max(filled["bytes_per_row"], 1e-9), 2),
    }


def export(args, work: Workdir, directory: str, rows: int) -> list[dict]:
    out = Path(work.sub("export")) / "t.pt"
    tool = [sys.executable, "-m", "paramserver", "--log-level", "WARNING", "checkpoint"]
    done = run_measured([*tool, "export", directory, "--out", str(out)], args.limit_s)
    size = out.stat().st_size if out.exists() else 0
    out.unlink(missing_ok=True)
    looked = run_measured([*tool, "inspect", directory], args.limit_s)
    try:
        seen = json.loads(looked["stdout"])["tables"][TABLE]["rows"]
    except (ValueError, KeyError):
        seen = None
    return [
        record("export", rows, args, tool=name, **figures(result), **extra)
        for name, result, extra in (("export", done, {"out_bytes": size}), ("inspect", looked, {"rows_seen": seen}))
    ]


def figures(result: dict) -> dict:
    """What to keep of `run_measured`'s result: the error's tail only where it failed."""
    kept = {key: result[key] for key in ("rc", "time_s", "peak_rss_mb")}
    return kept if result["rc"] == 0 else {**kept, "stderr": result["stderr"]}


def checkpoint_cases(args, work: Workdir, rows: int, emit) -> None:
    directory = work.sub("ckpt")
    try:
        written = checkpoint(args, work, rows, directory)
        emit(written)
        if "restore" in args.cases:
            for count in args.restore_ps:
                guarded(
                    emit, "restore", rows, args, lambda c=count: restore(args, work, directory, c, written["filled"])
                )
        if "export" in args.cases:
            guarded(emit, "export", rows, args, lambda: export(args, work, directory, rows))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---- main -------------------------------------------------------------------------------------
def guarded(emit, case: str, rows: int, args, run) -> None:
    """Emit what `run()` measured, or the error that stopped it (the next case still runs)."""
    try:
        result = run()
    except Exception as exc:  # a PS that died (out of memory?), a deadline: reported, not fatal
        result = record(case, rows, args, error=f"{type(exc).__name__}: {exc}"[-2000:])
    for line in result if isinstance(result, list) else [result]:
        emit(line)


def sizes(text: str) -> list[int]:
    """'5M,20M,50M' -> [5000000, 20000000, 50000000] (K, M, G suffixes)."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}
    return [int(float(s[:-1]) * scale[s[-1].upper()]) if s[-1].upper() in scale else int(s) for s in text.split(",")]


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="throughput,checkpoint,restore,export", help="comma-separated")
    parser.add_argument("--rows", type=sizes, default=sizes("5M,20M,50M"), help="table sizes (default 5M,20M,50M)")
    parser.add_argument("--limit-s", type=float, default=900, help="time bound of each case (default 900)")
    parser.add_argument("--measure-s", type=float, default=30, help="throughput: seconds of each steady phase")
    parser.add_argument("--space-factor", type=int, default=2, help="throughput: Zipf ranks in [0, this x rows)")
    parser.add_argument("--fill-batch", type=int, default=BATCH, help="checkpoint: new ids per fill lookup (65536)")
    parser.add_argument("--restore-ps", type=sizes, default=[1, 2, 4], help="restore: PS counts (default 1,2,4)")
    parser.add_argument("--ps-args", default="", help="appended to every PS's command line")
    parser.add_argument("--workdir", default="/tmp", help="parent of the temporary directory (default /tmp)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.cases = set(args.cases.split(","))
    unknown = args.cases - {"throughput", "checkpoint", "restore", "export"}
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}")
    return args


def interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    args = parse()
    for sig in (signal.SIGTERM, signal.SIGINT):  # a `kill` cleans up as Ctrl-C does (SIGINT: even in a background job)
        signal.signal(sig, interrupted)
    emit = lambda line: print(json.dumps(line), flush=True)
    try:
        with Workdir(args.workdir) as work:
            try:
                for rows in args.rows:
                    run_size(args, work, rows, emit)
            finally:  # a second Ctrl-C must not cut the cleanup short
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_IGN)
                PSProcess.stop_all()
    except KeyboardInterrupt:
        print("scale: interrupted; its processes were stopped and its files removed", file=sys.stderr, flush=True)
        sys.exit(130)


def run_size(args, work: Workdir, rows: int, emit) -> None:
    if "throughput" in args.cases:
        guarded(emit, "throughput", rows, args, lambda: throughput(args, work, rows))
    if args.cases & {"checkpoint", "restore", "export"}:  # checkpoint_cases emits its lines itself
        guarded(emit, "checkpoint", rows, args, lambda: checkpoint_cases(args, work, rows, emit) or [])


if __name__ == "__main__":
    main()
