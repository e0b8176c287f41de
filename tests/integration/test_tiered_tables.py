"""Tables bigger than memory on real PS processes: a PS with a table memory budget and a spill
directory trains as one without, stays within its memory, and keeps its spill files to itself (it
deletes only the subdirectories a PS marked as its own)."""

import fcntl
import json
import os
import signal

import numpy as np
import psutil
import pytest

from paramserver.client.ps_client import PSClient
from paramserver.client.table_client import TableClient
from paramserver.tables.embedding_table import initial_rows
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.wire import codec

pytestmark = pytest.mark.cluster  # real PS processes

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
INIT = {"kind": "normal", "std": 0.1}
BOUND_S = 60  # generous bound for waits; never a verdict


def start(procs, **options):
    proc, address = procs.start_ps(PARAMSERVER_OPTIONS=json.dumps({"drain_grace_s": 1.0, **options}))
    channel = GrpcChannel(address, 1 << 26)
    channel.wait_ready(BOUND_S)
    return proc, channel


def described(channel):
    return codec.decode(channel.call("Hello", codec.encode({}), BOUND_S).wait(BOUND_S)).meta["tables"]["t"]


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(BOUND_S) == 0


def test_a_ps_with_a_budget_trains_a_table_bigger_than_it_as_a_ps_without(procs, tmp_path):
    channels = [start(procs, table_memory_budget=256 << 10, spill_dir=str(tmp_path))[1], start(procs)[1]]
    clients = [TableClient([channel], BOUND_S) for channel in channels]
    for tables in clients:
        tables.register("t", 16, ADAGRAD, INIT)
    rng = np.random.default_rng(0)
    for _ in range(40):
        ids = np.unique(rng.integers(-20_000, 20_000, 2000)) * 7919
        tiered, memory = (tables.lookup("t", ids) for tables in clients)
        np.testing.assert_array_equal(tiered, memory)
        grads = rng.standard_normal((ids.shape[0], 16)).astype(np.float32)
        for channel, tables in zip(channels, clients):
            riders = tables.riders()
            riders.push("t", ids, grads)
            PSClient([channel], BOUND_S).push_pull({}, [], riders=riders).wait(BOUND_S)
    every = np.arange(-20_000, 20_000, dtype=np.int64) * 7919
    np.testing.assert_array_equal(clients[0].lookup("t", every), clients[1].lookup("t", every))
    tiered = described(channels[0])
    assert tiered["rows"] == described(channels[1])["rows"] == 40_000
    assert tiered["memory_rows"] < 4000 and tiered["disk_rows"] > 30_000 and tiered["bytes"] <= 256 << 10
    for channel in channels:
        channel.close()


def rss_growth(procs, rows, **options):
    """RSS (bytes) a PS gains holding `rows` new rows of dim 16 with Adagrad, made by lookups."""
    proc, channel = start(procs, **options)
    tables = TableClient([channel], BOUND_S)
    tables.register("t", 16, ADAGRAD, INIT)
    tables.lookup("t", np.arange(1000, dtype=np.int64))  # code paths warm
    before = psutil.Process(proc.pid).memory_info().rss
    for lo in range(0, rows, 50_000):
        tables.lookup("t", np.arange(lo, lo + 50_000, dtype=np.int64) + 10_000)
    assert described(channel)["rows"] == rows + 1000
    grown = psutil.Process(proc.pid).memory_info().rss - before
    channel.close()
    stop(proc)
    return grown


def test_a_ps_with_a_budget_stays_within_it_where_one_without_grows_with_its_rows(procs, tmp_path):
    rows, budget = 400_000, 4 << 20
    memory = rss_growth(procs, rows)
    tiered = rss_growth(procs, rows, table_memory_budget=budget, spill_dir=str(tmp_path))
    print(f"rss growth for {rows} rows: in memory {memory >> 20} MiB, tiered {tiered >> 20} MiB")
    assert memory > rows * 136  # values, sum and id alone
    assert tiered < budget + (48 << 20), (tiered, memory)  # its store's memory (16 MiB here) and a batch's arrays
    assert tiered < memory / 2


def test_the_spill_directory_is_the_ps_own_ignored_when_stale_and_removed_on_stop(procs, tmp_path):
    foreign = tmp_path / "shard-0-0123abcd"  # named as a PS names its own, but no PS made it (no marker)
    foreign.mkdir()
    (foreign / "LOCK").touch()
    (foreign / "000001.sst").write_bytes(b"not a PS's")
    live = tmp_path / "shard-0-live"  # another live PS with the same index, sharing the directory
    live.mkdir()
    lock = os.open(live / "LOCK", os.O_CREAT | os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        options = {"table_memory_budget": 1 << 16, "spill_dir": str(tmp_path)}
        proc, channel = start(procs, **options)
        own = [p for p in tmp_path.iterdir() if p not in (live, foreign)]
        assert len(own) == 1 and own[0].name.startswith("shard-0-")
        ids = np.arange(3000, dtype=np.int64)
        tables = TableClient([channel], BOUND_S)
        tables.register("t", 4, ADAGRAD, INIT)
        riders = tables.riders()
        tables.lookup("t", ids)
        riders.push("t", ids, np.ones((3000, 4), np.float32))
        PSClient([channel], BOUND_S).push_pull({}, [], riders=riders).wait(BOUND_S)
        assert described(channel)["disk_rows"] > 0
        channel.close()
        proc.kill()  # killed: its spill files stay behind, stale
        proc.wait(BOUND_S)
        assert own[0].exists()
        proc, channel = start(procs, **options)
        assert not own[0].exists() and live.exists() and foreign.exists()
        tables = TableClient([channel], BOUND_S)
        tables.register("t", 4, ADAGRAD, INIT)
        np.testing.assert_array_equal(tables.lookup("t", ids), initial_rows(ids, 4, INIT))  # nothing trusted
        channel.close()
        stop(proc)
        assert sorted(tmp_path.iterdir()) == [foreign, live]  # its own went when it stopped
    finally:
        os.close(lock)
