"""Whole-table operations in bounded memory, on real PS processes: a checkpoint streams the table
(no copy of it), a restore onto 3 PS reads only each one's rows, and export streams too.

Each process runs under a memory cap that a copy of the table would exceed (a cgroup, where this
machine lets the test make one), and its peak RSS (VmHWM) is checked against the same bound."""

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from tests.conftest import ROOT

from paramserver.base.hashing import shard_of
from paramserver.checkpoint.store import CheckpointStore
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.wire import codec

pytestmark = pytest.mark.cluster  # real PS processes and the checkpoint tool

DIM, ROWS, BATCH = 64, 600_000, 60_000
ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
TABLE = {"table": "t", "dim": DIM, "optimizer": ADAGRAD, "init": {"kind": "normal", "std": 0.1}}
ROW_BYTES = 4 * DIM * 2  # values and Adagrad state
TABLE_BYTES = ROWS * ROW_BYTES  # ~300 MB: the part a copy would double
CGROUP = Path("/sys/fs/cgroup/memory")


@contextlib.contextmanager
def memory_cap(limit: int):
    """A cgroup (v1 memory) capped at `limit` bytes; yields a function that moves a PID into it,
    or None where the test cannot make one (then only VmHWM is checked)."""
    path = CGROUP / f"paramserver-test-{uuid.uuid4().hex[:8]}"
    try:
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(limit))
    except OSError:
        yield None
        return
    try:
        yield lambda pid: (path / "cgroup.procs").write_text(str(pid))
    finally:
        for proc in (path / "cgroup.procs").read_text().split():  # only ours; they are stopped by then
            with contextlib.suppress(OSError):
                (CGROUP / "cgroup.procs").write_text(proc)
        path.rmdir()


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def call(channel, method, meta, tensors=()):
    return codec.decode(channel.call(method, codec.encode(meta, list(tensors)), 120).wait(120))


def connect(address):
    channel = GrpcChannel(address, 1 << 30, use_stream=False)
    channel.wait_ready(60)
    return channel


def start_ps(procs, index, directory, resume=False):
    options = {"checkpoint_dir": str(directory), "resume": resume}
    proc, address = procs.start_ps(index=index, PARAMSERVER_OPTIONS=json.dumps(options))
    return proc, connect(address)


def fill(channel, num_shards=1, shard=0):
    """Create ROWS rows (the ids that hash to `shard`) and update each once."""
    ids = np.arange(ROWS, dtype=np.int64) * 7919 + 11
    ids = ids[shard_of(ids, num_shards) == shard]
    for lo in range(0, ids.shape[0], BATCH):
        batch = ids[lo : lo + BATCH]
        call(channel, "Lookup", {"table": "t"}, [("ids", batch)])
        call(channel, "PushPull", {"rows": [["t", "r.ids", "r.grads"]]},
             [("r.ids", batch), ("r.grads", np.full((batch.shape[0], DIM), 0.5, np.float32))])
    return ids


def table_rows(channel):
    return call(channel, "Hello", {}).meta["tables"]["t"]["rows"]


def test_checkpoint_restore_onto_three_ps_and_export_stay_within_a_cap_a_table_copy_would_pass(procs, tmp_path):
    directory = tmp_path / "ckpt"
    proc, channel = start_ps(procs, 0, directory)
    baseline = rss(proc.pid)
    cap = baseline + TABLE_BYTES * 2  # the table (+ index, ids) fits; a copy of it would not
    with memory_cap(cap) as enter:
        if enter:
            enter(proc.pid)
        call(channel, "RegisterTable", TABLE)
        ids = fill(channel)
        filled = rss(proc.pid)
        os.kill(proc.pid, 0)
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM from now on
        entry = call(channel, "Checkpoint", {"name": "ckpt-000000001"}).meta
        during = peak_rss(proc.pid)
        values = call(channel, "Lookup", {"table": "t"}, [("ids", ids[:1000])]).tensors["rows"].copy()
    assert during <= filled + 0.1 * (filled - baseline) + (48 << 20), (baseline, filled, during)
    CheckpointStore(str(directory)).commit("ckpt-000000001", {"step": 1, "num_shards": 1, "shards": [entry]})
    channel.close()
    proc.kill()
    proc.wait()

    # restore onto 3 PS: each holds only its own rows, in about a third of the memory
    share = TABLE_BYTES * 2 // 3
    restored = []
    for index in range(3):
        with memory_cap(baseline + share + (64 << 20)) as enter:
            proc, channel = start_ps(procs, index, directory, resume=True)
            if enter:
                enter(proc.pid)
            call(channel, "RegisterTable", {**TABLE, "num_shards": 3})
            mine = ids[shard_of(ids, 3) == index]
            assert table_rows(channel) == mine.shape[0]
            restored.append((proc, channel, peak_rss(proc.pid)))
    for index, (proc, channel, peak) in enumerate(restored):
        assert peak <= baseline + share, (index, baseline, peak)
        first = ids[:1000][shard_of(ids[:1000], 3) == index]
        got = call(channel, "Lookup", {"table": "t"}, [("ids", first)]).tensors["rows"]
        np.testing.assert_array_equal(got, values[shard_of(ids[:1000], 3) == index])
        channel.close()

    # export streams: its peak RSS stays far below the table's bytes
    out = tmp_path / "model.safetensors"
    export = subprocess.run([sys.executable, "-c", EXPORT, str(directory), str(out)], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert export.returncode == 0, export.stderr
    peak = int(export.stdout.split()[-1])
    assert peak < TABLE_BYTES // 2, peak
    with safe_open(str(out), framework="numpy") as saved:
        exported_ids = saved.get_tensor("embeddings/t/ids")
        order = np.argsort(exported_ids)
        at = np.searchsorted(exported_ids[order], ids[:1000])
        np.testing.assert_array_equal(saved.get_tensor("embeddings/t/weight")[order[at]], values)


EXPORT = """
import sys
from paramserver.checkpoint import tools
tools.export(sys.argv[1], None, sys.argv[2])
status = open("/proc/self/status").read().split("VmHWM:")[1]  # not ru_maxrss: it keeps the forking parent's
print(int(status.split()[0]) * 1024)
"""
