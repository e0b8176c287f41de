"""What a checkpoint costs, whole and incremental: a ROWS-row dim-16 Adagrad table on one PS.

The table is built in this process (a TableStore, as a PS holds it) and written through the real
write path (checkpoint/shard_writes.py: the snapshot, the streamed safetensors file, its fsync and
SHA-256, then the manifest). Steps, each timed:

1. a whole checkpoint (the base): bytes and seconds (`base_s`: the write, with its checks as
   written, the chief's check before the commit as worker/recovery/checkpoints.py runs it, and the
   commit; `base_check_s`: that check alone, absent where the code has none; `base_rehash_s`: one
   more SHA-256 pass over the base file just written, from the page cache, for scale);
2. about 1% of the rows trained (one Adagrad step each), then a delta: bytes and seconds;
3. nine more such rounds (base + 10 deltas), then two restores into a fresh table, each with
   every file checked (SHA-256, finiteness) as a resume checks them: the base alone (one whole
   checkpoint of the same size) and the chain.

Prints one JSON line with the figures and the goals (delta <= 3% of the base's bytes and <= 5% of
its time; chain restore <= 1.5x the whole one's). Files go under a temporary directory (--dir's
parent), deleted at the end whatever happens; --deadline bounds the run (checked between steps).

With ``--quantize bf16|int8`` the table's rows are stored as bfloat16, or int8 with a float32
scale per row (the PS option ``checkpoint_quantize``); its optimizer state stays float32.

With ``--delta-export``, ``paramserver checkpoint export --since`` of the newest checkpoint is timed
too: since its parent (one delta's rows) and since the base (ten deltas' rows); every file of the
chain is checked first, as for any export.

    PYTHONPATH=src python bench/checkpoint_cost.py [--rows 20000000] [--touch 0.01] [--deltas 10]
        [--quantize none|bf16|int8] [--delta-export]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.shard_writes import ShardWrites
from paramserver.checkpoint.store import checkpoint_name
from paramserver.server.shard import Shard
from paramserver.tables.limits import TableLimits
from paramserver.tables.table_store import TableStore

try:  # the chief's check before a commit; absent from older code (then not timed)
    from paramserver.checkpoint.verdict import check_checkpoint
except ImportError:
    check_checkpoint = None

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.05}}
INIT = {"kind": "normal", "std": 0.01}
DIM = 16
BATCH = 1 << 20  # ids per lookup or push (a PS's default maximum)


def new_store(rows: int, restore=None) -> TableStore:
    limits = TableLimits(max_rows=max(rows * 2, 1 << 27), max_bytes=64 << 30)
    tables = TableStore(0, restore=restore, limits=limits)
    tables.register("emb", DIM, ADAGRAD, INIT, capacity=rows)
    return tables


def build(rows: int) -> TableStore:
    tables = new_store(rows)
    for lo in range(0, rows, BATCH):
        tables.lookup("emb", np.arange(lo, min(lo + BATCH, rows), dtype=np.int64))
    return tables


def touch(tables: TableStore, rows: int, share: float, rng: np.random.Generator) -> int:
    """One Adagrad step on about `share` of the rows (distinct random ids); returns how many."""
    ids = np.unique(rng.integers(0, rows, int(rows * share)))
    for lo in range(0, ids.shape[0], BATCH):
        part = ids[lo : lo + BATCH]
        grads = rng.normal(0, 0.1, (part.shape[0], DIM)).astype(np.float32)
        tables.push_checked([tables.check_push("emb", part, grads)])
    return int(ids.shape[0])


def checkpoint(writes: ShardWrites, shard: Shard, step: int, parent: str) -> tuple[int, float, float | None]:
    """Write, check as the chief does before its commit (where the code has the check) and commit
    checkpoint `step` (a delta on `parent` when given): (bytes, seconds, seconds of the check)."""
    name = checkpoint_name(step)
    started = time.perf_counter()
    entry = writes(name, shard, parent=parent)
    manifest = {"step": step, "num_shards": 1, "shards": [entry]}
    check_s = None
    if check_checkpoint is not None:
        check_started = time.perf_counter()
        check_checkpoint(writes.store, name, manifest=manifest, contents=False)
        check_s = time.perf_counter() - check_started
    writes.store.commit(name, manifest)
    took = time.perf_counter() - started
    if bool(entry.get("parent")) != bool(parent):
        raise RuntimeError(f"{name}: asked for {'a delta' if parent else 'a base'}, got {entry}")
    return entry["bytes"], took, check_s


def rehash(path: str) -> float:
    """Seconds of one SHA-256 pass over the file at `path` (8 MiB at a time)."""
    started = time.perf_counter()
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return time.perf_counter() - started


def restore(writes: ShardWrites, step: int, rows: int) -> tuple[float, int]:
    """Open checkpoint `step` (every file of its chain checked) and fill a fresh table: (seconds, rows)."""
    gc.collect()
    started = time.perf_counter()
    source = RestoreSource(writes.store, checkpoint_name(step))
    tables = new_store(rows, restore=source)
    took = time.perf_counter() - started
    size = tables.table("emb").size
    del tables, source
    gc.collect()
    return took, size


def delta_exports(workdir: str, deltas: int) -> dict:
    """`export --since` the newest checkpoint's parent, then the base: (bytes, seconds) of each file."""
    from paramserver.checkpoint.export.delta_export import export_delta

    found = {}
    for label, since in (("one_delta", deltas), ("ten_deltas", 1)):
        out = f"{workdir}/delta-{label}.safetensors"
        started = time.perf_counter()
        export_delta(workdir, checkpoint_name(deltas + 1), checkpoint_name(since), out)
        found[f"delta_export_{label}_s"] = round(time.perf_counter() - started, 2)
        found[f"delta_export_{label}_bytes"] = os.path.getsize(out)
        os.unlink(out)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--touch", type=float, default=0.01, help="share of the rows trained between checkpoints")
    parser.add_argument("--deltas", type=int, default=10)
    parser.add_argument("--quantize", choices=["none", "bf16", "int8"], default="none", help="rows' encoding")
    parser.add_argument(
        "--delta-export", action="store_true", help="also time `checkpoint export --since` over 1 and over 10 deltas"
    )
    parser.add_argument("--dir", default=None, help="where the temporary checkpoint directory goes")
    parser.add_argument("--deadline", type=float, default=900.0, help="seconds the whole run may take")
    args = parser.parse_args()
    started = time.monotonic()

    def check_time(what: str) -> None:
        if time.monotonic() - started > args.deadline:
            raise SystemExit(f"checkpoint_cost: past --deadline {args.deadline:.0f}s before {what}")

    workdir = tempfile.mkdtemp(prefix="checkpoint-cost-", dir=args.dir)
    try:
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        tables = build(args.rows)
        build_s = time.perf_counter() - t0
        shard, writes = Shard(0, tables=tables), ShardWrites(workdir, args.quantize)
        base_bytes, base_s, base_check_s = checkpoint(writes, shard, 1, "")
        base_rehash_s = rehash(writes.store.path(checkpoint_name(1), "shard-0.safetensors"))
        check_time("the first delta")
        touched = touch(tables, args.rows, args.touch, rng)
        delta_bytes, delta_s, delta_check_s = checkpoint(writes, shard, 2, checkpoint_name(1))
        later = []
        for step in range(3, args.deltas + 2):
            check_time(f"delta {step - 1}")
            touch(tables, args.rows, args.touch, rng)
            later.append(checkpoint(writes, shard, step, checkpoint_name(step - 1)))
        live_rows = tables.table("emb").size
        del shard, tables
        gc.collect()
        check_time("the restores")
        whole_restore_s, whole_rows = restore(writes, 1, args.rows)
        chain_restore_s, chain_rows = restore(writes, args.deltas + 1, args.rows)
        if (whole_rows, chain_rows) != (args.rows, live_rows):
            raise RuntimeError(f"restored {whole_rows} and {chain_rows} rows, not {args.rows} and {live_rows}")
        result = {
            "bench": "checkpoint_cost",
            "rows": args.rows,
            "dim": DIM,
            "optimizer": "adagrad",
            "quantize": args.quantize,
            "build_s": round(build_s, 2),
            "base_bytes": base_bytes,
            "base_s": round(base_s, 3),
            "base_check_s": None if base_check_s is None else round(base_check_s, 4),
            "base_rehash_s": round(base_rehash_s, 3),
            "touched_rows": touched,
            "delta_bytes": delta_bytes,
            "delta_s": round(delta_s, 3),
            "delta_check_s": None if delta_check_s is None else round(delta_check_s, 4),
            "delta_bytes_share": round(delta_bytes / base_bytes, 4),
            "delta_time_share": round(delta_s / base_s, 4),
            "later_delta_s_max": round(max((s for _, s, _ in later), default=0.0), 3),
            "chain_bytes": base_bytes + delta_bytes + sum(b for b, _, _ in later),
            "whole_restore_s": round(whole_restore_s, 2),
            "chain_restore_s": round(chain_restore_s, 2),
            "chain_links": args.deltas + 1,
            "restore_ratio": round(chain_restore_s / whole_restore_s, 3),
            "goals_met": {
                "delta_bytes_le_3pct": delta_bytes <= 0.03 * base_bytes,
                "delta_time_le_5pct": delta_s <= 0.05 * base_s,
                "chain_restore_le_1_5x": chain_restore_s <= 1.5 * whole_restore_s,
            },
            "total_s": round(time.monotonic() - started, 1),
        }
        if args.delta_export:
            result.update(delta_exports(workdir, args.deltas))
        print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
