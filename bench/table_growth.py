"""An embedding table growing to `--rows` rows: the longest pause a single lookup sees, and bytes per row.

Inserts `--rows` new ids in batches of `--batch` (each batch one `read()`, as a shard's lookup),
into one EmbeddingTable (dim `--dim`, Adagrad), timing every call. Prints one JSON line:
max and p99 call time (ms), total insert time (s), bytes per row from the process's RSS growth
(VmRSS, and its peak VmHWM) and from the table's own `describe()["bytes"]`, next to the raw
bytes of a row (values + Adagrad state + its 8-byte id).

`--max-rss-gib` stops the run early (reported as "stopped_at") when the process passes it,
so a run on a shared machine stays bounded.

    python bench/table_growth.py [--rows 50000000] [--batch 65536] [--dim 16] [--max-rss-gib 64]
"""

import argparse
import json
import time

import numpy as np

from paramserver.tables.embedding_table import EmbeddingTable
from paramserver.tables.sparse_optimizers import build_sparse_optimizer

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
_SPREAD = np.int64(-7046029254386353131)  # an odd multiplier: distinct ids stay distinct, spread over int64


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def run(rows: int, batch: int, dim: int, max_rss_gib: float) -> dict:
    table = EmbeddingTable("t", dim, build_sparse_optimizer(ADAGRAD), {"kind": "normal", "std": 0.01}, ADAGRAD)
    rss0 = status_kib("VmRSS")
    pauses, stopped_at = [], None
    started = time.perf_counter()
    for lo in range(0, rows, batch):
        ids = np.arange(lo, min(lo + batch, rows), dtype=np.int64) * _SPREAD
        t0 = time.perf_counter()
        table.read(ids)
        pauses.append(time.perf_counter() - t0)
        if status_kib("VmRSS") > max_rss_gib * (1 << 20):
            stopped_at = table.size
            break
    total = time.perf_counter() - started
    rss_kib = status_kib("VmRSS") - rss0
    ms = np.array(pauses) * 1e3
    return {
        "rows": table.size,
        "batch": batch,
        "dim": dim,
        "calls": len(pauses),
        "max_pause_ms": round(float(ms.max()), 1),
        "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "median_ms": round(float(np.median(ms)), 1),
        "total_s": round(total, 1),
        "rss_bytes_per_row": round(rss_kib * 1024 / table.size, 1),
        "peak_rss_gib": round(status_kib("VmHWM") / (1 << 20), 2),
        "table_bytes_per_row": round(table.describe()["bytes"] / table.size, 1),
        "raw_bytes_per_row": 4 * dim * 2 + 8,
        "stopped_at": stopped_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000_000)
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--max-rss-gib", type=float, default=64.0)
    args = parser.parse_args()
    print(json.dumps(run(args.rows, args.batch, args.dim, args.max_rss_gib)))


if __name__ == "__main__":
    main()
