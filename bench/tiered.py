"""Tables bigger than memory (docs/scaling.md, "Tiered tables"). Two measurements, one JSON line each:

- `table`: a TieredTable in this process (dim 16, Adagrad) under a memory budget: N rows made by
  lookups of 65,536 new ids at a time (the fill), then training steps (a lookup and a push of the
  distinct ids among B draws) drawn uniformly and with a Zipf skew (a = 1.1); rows/s (distinct
  ids, each looked up and updated), the longest call and the 99th percentile (a fill's lookup, a
  step's lookup + push), memory bytes per row (the memory tier at capacity / its rows), disk bytes
  per row (RocksDB's files, before and after a full compaction), the process's RssAnon and RssFile.
  With `--memory`, the same fill and steps on an in-memory EmbeddingTable first (of `--memory-rows`
  rows, default N: give fewer where N rows do not fit in memory), and each tiered rate over its
  in-memory one.
- `stores`: batch get/put of 8-byte keys and 136-byte values at random ids, in RocksDB (rocksdict,
  as spill_store.py sets it up) and, when the `lmdb` package is installed, in LMDB; RSS of each in
  a process of its own.

    python bench/tiered.py table [--rows 2000000] [--budget 64MiB] [--batch 16384] [--steps 100] [--memory]
        [--memory-rows N] [--init normal|uniform|zeros]
    python bench/tiered.py stores [--rows 3000000]
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from paramserver.base.byte_size import parse_byte_size  # noqa: E402
from paramserver.tables.embedding_table import EmbeddingTable, RowPolicy  # noqa: E402
from paramserver.tables.sparse_optimizers import build_sparse_optimizer  # noqa: E402
from paramserver.tables.tiered.tiers import Tiers  # noqa: E402

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.05}}


def rss_mib() -> dict:
    wanted = ("RssAnon", "RssFile")
    lines = (line.split(":") for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(value.split()[0]) >> 10 for key, value in lines if key in wanted}


FILL = 1 << 16  # new ids per lookup while filling


def _tiered(args):
    spill = tempfile.mkdtemp(prefix="tiered-bench-")
    tiers = Tiers.create(args.budget, spill, 0)
    table = tiers.new_table("t", 16, build_sparse_optimizer(ADAGRAD), {"kind": args.init}, ADAGRAD, RowPolicy())

    def close() -> None:
        tiers.close()
        shutil.rmtree(spill, ignore_errors=True)

    return table, close


def _in_memory(rows: int, init: str):
    table = EmbeddingTable("t", 16, build_sparse_optimizer(ADAGRAD), {"kind": init}, ADAGRAD, capacity=rows)
    return table, lambda: None


def _step(t, ids: np.ndarray, grads: np.ndarray | None) -> float:
    """Seconds of one lookup (a fill's) or of one lookup and push (a training step's)."""
    started = time.perf_counter()
    t.read(ids)
    if grads is not None:
        t.apply(ids, grads)
    return time.perf_counter() - started


def _latency(name: str, calls: list[float]) -> dict:
    return {f"{name}_longest_s": round(max(calls), 3), f"{name}_p99_s": round(float(np.quantile(calls, 0.99)), 3)}


def workload(t, rows: int, args) -> dict:
    """The fill and the training steps on table `t`: rates and latencies."""
    out: dict = {}
    calls: list[float] = []
    started = time.perf_counter()
    for lo in range(0, rows, FILL):
        ids = np.arange(lo, min(lo + FILL, rows), dtype=np.int64)
        calls.append(_step(t, ids, None))
        if (lo // FILL) % 160 == 159:  # about every 10M rows: a run cut short still tells
            took = time.perf_counter() - started
            print(json.dumps({"filled": lo + FILL, "s": round(took), **_latency("create", calls)}), file=sys.stderr)
    out["create_rows_per_s"] = round(rows / (time.perf_counter() - started))
    out.update(_latency("create", calls))
    print(json.dumps(out), file=sys.stderr, flush=True)  # each phase as it ends: a run cut short still tells
    rng = np.random.default_rng(0)
    for name, draw in (
        ("uniform", lambda: rng.integers(0, rows, args.batch)),
        ("zipf", lambda: (rng.zipf(1.1, args.batch) - 1) % rows),
    ):
        reads, touched, calls = getattr(getattr(t, "store", None), "reads", 0), 0, []
        started = time.perf_counter()
        for _ in range(args.steps):
            ids = np.unique(draw()).astype(np.int64)
            grads = rng.standard_normal((ids.shape[0], 16)).astype(np.float32)
            calls.append(_step(t, ids, grads))
            touched += ids.shape[0]
        took = time.perf_counter() - started
        out[f"{name}_rows_per_s"] = round(touched / took)
        out.update(_latency(name, calls))
        if hasattr(t, "store"):
            out[f"{name}_disk_reads_per_row"] = round((t.store.reads - reads) / touched, 3)
        print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def table(args) -> dict:
    out: dict = {"rows": args.rows, "budget": args.budget, "batch": args.batch, "steps": args.steps}
    if args.memory:
        rows = args.memory_rows or args.rows
        t, close = _in_memory(rows, args.init)
        try:
            out["memory"] = {"rows": rows, **workload(t, rows, args)}
        finally:
            del t
            close()
    t, close = _tiered(args)
    try:
        out["memory_capacity"] = t.hot.capacity
        out.update(workload(t, args.rows, args))
        if args.memory:
            for name in ("create", "uniform", "zipf"):
                rate = out[f"{name}_rows_per_s"] / out["memory"][f"{name}_rows_per_s"]
                out[f"{name}_vs_memory"] = round(rate, 3)
        out["memory_bytes_per_row"] = round(t.hot.nbytes / t.hot.capacity, 1)
        out["disk_bytes_per_row"] = round(t.store.disk_bytes() / t.size, 1)
        t.store.db.compact_range(None, None)
        out["disk_bytes_per_row_compacted"] = round(t.store.disk_bytes() / t.size, 1)
        out["store_memory_bytes_per_row"] = round(t.store.memory_bytes() / t.size, 2)
        started = time.perf_counter()
        saved = sum(arrays["ids"].shape[0] for _, arrays in t.row_chunks(1 << 16))
        out["row_chunks_rows_per_s"] = round(saved / (time.perf_counter() - started))
        out["rss_mib"] = rss_mib()
        return out
    finally:
        close()


STORE_SCRIPT = r"""
import json, shutil, sys, tempfile, time
import numpy as np
kind, n = sys.argv[1], int(sys.argv[2])
batch, size = 100_000, 136
path = tempfile.mkdtemp(prefix="tiered-store-")
def rss():
    lines = (l.split(":") for l in open("/proc/self/status").read().splitlines())
    return {k: int(v.split()[0]) >> 10 for k, v in lines if k in ("RssAnon", "RssFile")}
def keys(ids):
    b = (ids.view(np.uint64) ^ np.uint64(1 << 63)).astype(">u8").tobytes()
    return [b[i:i + 8] for i in range(0, len(b), 8)]
def values(m):
    b = np.random.default_rng(m).integers(0, 255, m * size, dtype=np.uint8).tobytes()
    return [b[i:i + size] for i in range(0, len(b), size)]
if kind == "lmdb":
    import lmdb
    env = lmdb.open(path, map_size=64 << 30, sync=False, metasync=False, readahead=False, lock=False)
    def put(k, v):
        with env.begin(write=True) as txn:
            txn.cursor().putmulti(zip(k, v))
    def get(k):
        with env.begin() as txn:
            return [txn.get(x) for x in k]
else:
    from paramserver.tables.tiered.spill_store import GET_BATCH, StoreMemory, _options
    import rocksdict
    db = rocksdict.Rdict(path, _options(StoreMemory()))
    write = rocksdict.WriteOptions()
    write.disable_wal = True
    def put(k, v):
        wb = rocksdict.WriteBatch(raw_mode=True)
        for a, b in zip(k, v):
            wb.put(a, b)
        db.write(wb, write)
    def get(k):
        return [x for lo in range(0, len(k), GET_BATCH) for x in db.get(k[lo:lo + GET_BATCH])]
rng = np.random.default_rng(0)
ids = rng.integers(-(1 << 62), 1 << 62, n, dtype=np.int64)
out = {"store": kind, "rows": n}
t = time.perf_counter()
for lo in range(0, n, batch):
    put(keys(ids[lo:lo + batch]), values(min(batch, n - lo)))
out["load_per_s"] = round(n / (time.perf_counter() - t))
t = time.perf_counter()
for _ in range(20):
    assert all(x is not None for x in get(keys(ids[rng.integers(0, n, batch)])))
out["get_per_s"] = round(20 * batch / (time.perf_counter() - t))
t = time.perf_counter()
for i in range(20):
    put(keys(ids[rng.integers(0, n, batch)]), values(batch))
out["update_per_s"] = round(20 * batch / (time.perf_counter() - t))
out["rss_mib"] = rss()
files = __import__("pathlib").Path(path).rglob("*")
out["disk_bytes_per_row"] = round(sum(p.stat().st_size for p in files if p.is_file()) / n, 1)
shutil.rmtree(path, ignore_errors=True)
print(json.dumps(out))
"""


def stores(args) -> list[dict]:
    results = []
    for kind in ("rocksdb", "lmdb"):
        if kind == "lmdb" and subprocess.run([sys.executable, "-c", "import lmdb"], capture_output=True).returncode:
            continue
        env = {"PYTHONPATH": str(ROOT / "src")}
        done = subprocess.run(
            [sys.executable, "-c", STORE_SCRIPT, kind, str(args.rows)], capture_output=True, text=True, env=env
        )
        failed = {"store": kind, "error": done.stderr[-500:]}
        results.append(json.loads(done.stdout) if done.returncode == 0 else failed)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["table", "stores"])
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--budget", type=parse_byte_size, default=64 << 20)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--init", default="normal", help="rows' initializer (zeros: no hashing, a quicker fill)")
    parser.add_argument("--memory", action="store_true", help="the same on an in-memory table first")
    parser.add_argument("--memory-rows", type=int, default=None, help="rows of the in-memory table (default --rows)")
    args = parser.parse_args()
    if args.what == "table":
        args.rows = args.rows or 2_000_000
        print(json.dumps(table(args)), flush=True)
    else:
        args.rows = args.rows or 3_000_000
        for result in stores(args):
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
