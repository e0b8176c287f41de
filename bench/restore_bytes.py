"""Bytes a resuming PS reads: a checkpoint of ROWS rows (dim 16, Adagrad) written by 2 PS, restored
onto 2 PS (each its own shard) and onto 3 (every old file holds rows of every new shard).

The checkpoint is written through the real write path (checkpoint/files/shard_file.py, one PS's
TableStore at a time, ids routed by `shard_of` as a PS holds them). Each restoring PS is a process
of its own that does what a resuming PS does: choose the checkpoint (`RestoreSource.latest`, with
`contents=False` where the code has it: the PS's choice; the older code checks every file whole)
and fill its table as a registration does (TableStore.register with the new shard count). Bytes
read are the process's ``rchar`` (/proc/self/io: every byte read() returned, page cache or disk),
counted from just before the choice to the end of the fill; its share is the checkpoint's bytes
over the new PS count.

Prints one JSON line: per PS bytes read, its share, their ratio and seconds, for 2 -> 2 and 2 -> 3,
and the goal (<= 1.2x the share for the same PS count). Files go under a temporary directory (--dir's
parent), deleted at the end whatever happens.

    PYTHONPATH=src python bench/restore_bytes.py [--rows 20000000] [--to 2,3]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from paramserver.base.hashing import shard_of
from paramserver.checkpoint.files import shard_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointStore, checkpoint_name
from paramserver.server.shard import Shard
from paramserver.tables.limits import TableLimits
from paramserver.tables.table_store import TableStore

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.05}}
INIT = {"kind": "normal", "std": 0.01}
DIM = 16
BATCH = 1 << 20  # ids per lookup
WRITERS = 2
NAME = checkpoint_name(1)


def new_store(index: int, rows: int, num_shards: int, restore=None) -> TableStore:
    limits = TableLimits(max_rows=max(rows * 2, 1 << 27), max_bytes=64 << 30)
    tables = TableStore(index, restore=restore, limits=limits)
    tables.register("emb", DIM, ADAGRAD, INIT, capacity=rows, num_shards=num_shards)
    return tables


def write_checkpoint(directory: str, rows: int) -> int:
    """Checkpoint NAME of `rows` rows written by WRITERS PS, one at a time; returns its bytes."""
    store, entries = CheckpointStore(directory), []
    for index in range(WRITERS):
        tables = new_store(index, rows // WRITERS + rows // 100, WRITERS)
        for lo in range(0, rows, BATCH):
            ids = np.arange(lo, min(lo + BATCH, rows), dtype=np.int64)
            tables.lookup("emb", ids[shard_of(ids, WRITERS) == index])
        entries.append(shard_file.write(store, NAME, Shard(index, tables=tables), tables).__dict__)
        del tables
        gc.collect()
    store.commit(NAME, {"step": 1, "num_shards": WRITERS, "shards": entries})
    return sum(entry["bytes"] for entry in entries)


def rchar() -> int:
    with open("/proc/self/io") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("rchar:"))


def restore_one(directory: str, index: int, num_shards: int, rows: int) -> dict:
    """One PS's resume: choose the checkpoint, fill its table; bytes read and seconds."""
    store = CheckpointStore(directory)
    chunked = "contents" in inspect.signature(RestoreSource.latest).parameters
    before, started = rchar(), time.perf_counter()
    source = RestoreSource.latest(store, contents=False) if chunked else RestoreSource.latest(store)
    if source is None or source.name != NAME:
        raise RuntimeError(f"resumed from {source and source.name}, not {NAME}")
    chosen_read = rchar() - before
    tables = new_store(index, rows // num_shards + rows // 50, num_shards, restore=source)
    return {
        "ps": index,
        "read_bytes": rchar() - before,
        "choose_read_bytes": chosen_read,
        "rows": tables.table("emb").size,
        "s": round(time.perf_counter() - started, 2),
        "chunk_checked": chunked,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20_000_000)
    parser.add_argument("--to", default="2,3", help="PS counts to restore onto")
    parser.add_argument("--dir", default=None, help="where the temporary checkpoint directory goes")
    parser.add_argument("--restore-one", nargs=3, type=int, metavar=("INDEX", "SHARDS", "ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.restore_one:
        print(json.dumps(restore_one(args.dir, *args.restore_one)))
        return
    workdir = tempfile.mkdtemp(prefix="restore-bytes-", dir=args.dir)
    try:
        started = time.perf_counter()
        total = write_checkpoint(workdir, args.rows)
        result: dict = {
            "bench": "restore_bytes",
            "rows": args.rows,
            "dim": DIM,
            "optimizer": "adagrad",
            "written_by": WRITERS,
            "checkpoint_bytes": total,
            "write_s": round(time.perf_counter() - started, 1),
        }
        for count in (int(n) for n in args.to.split(",")):
            share, found = total / count, []
            for index in range(count):
                command = [sys.executable, __file__, "--dir", workdir, "--restore-one", str(index), str(count)]
                line = (
                    subprocess.run([*command, str(args.rows)], check=True, capture_output=True, text=True, timeout=900)
                    .stdout.strip()
                    .splitlines()[-1]
                )
                one = json.loads(line)
                one.update(share_bytes=round(share), ratio=round(one["read_bytes"] / share, 3))
                found.append(one)
            if sum(one["rows"] for one in found) != args.rows:
                raise RuntimeError(
                    f"{WRITERS} -> {count}: restored {[one['rows'] for one in found]} rows of {args.rows}"
                )
            result[f"{WRITERS}->{count}"] = found
            result[f"{WRITERS}->{count}_max_ratio"] = max(one["ratio"] for one in found)
        result["goal_same_count_ratio"] = 1.2
        print(json.dumps(result))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
