"""A tiered PS whose spill store breaks fails visibly and recovers, on real processes: its spill
directory deleted mid-run (the PS says why, exits for recovery, and the run finishes), its disk full
(rows in memory still answer, health NOT_SERVING with the cause, writes resume once there is room,
SIGTERM stops it cleanly), and a spill directory that is a symbolic link (refused: nothing behind it
is deleted)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from tests.fault.launcher_run import LauncherRun

from paramserver.base.errors import ResourceExhaustedError
from paramserver.client.ps_client import PSClient
from paramserver.client.table_client import TableClient
from paramserver.node.ps_process import SPILL_FAILED_EXIT_CODE
from paramserver.transport import health
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.wire import codec

pytestmark = pytest.mark.fault  # fault injection on real PS processes

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
INIT = {"kind": "normal", "std": 0.1}
BOUND_S = 60  # generous bound for waits; never a verdict
SCRIPT = "tests/integration/scripts/train_tiered.py"


def start_ps(procs, tmp_path, spill, budget=256 << 10):
    """A PS process with a table memory budget; its log (WARNING and up) goes to a file. Returns
    (process, channel or None when it did not start, log path)."""
    log = tmp_path / f"ps-{time.monotonic_ns()}.log"
    options = {"table_memory_budget": budget, "spill_dir": str(spill), "drain_grace_s": 1.0}
    with open(log, "w") as err:
        proc = procs.start(
            [
                sys.executable,
                "-m",
                "paramserver",
                "--log-level",
                "WARNING",
                "node",
                "--role",
                "ps",
                "--index",
                "0",
                "--bind",
                "127.0.0.1:0",
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=procs.env(PARAMSERVER_OPTIONS=json.dumps(options)),
        )
    line = proc.stdout.readline()
    if not line.startswith("PARAMSERVER_READY"):
        proc.wait(BOUND_S)
        return proc, None, log
    channel = GrpcChannel(line.split()[-1], 1 << 26)
    channel.wait_ready(BOUND_S)
    return proc, channel, log


def described(channel):
    return codec.decode(channel.call("Hello", codec.encode({}), BOUND_S).wait(BOUND_S)).meta["tables"]["t"]


def push(channel, tables, ids, grads):
    riders = tables.riders()
    riders.push("t", ids, grads)
    PSClient([channel], BOUND_S).push_pull({}, [], riders=riders).wait(BOUND_S)


def test_a_ps_whose_spill_dir_is_deleted_says_why_and_exits_for_recovery_without_a_traceback(procs, tmp_path):
    spill = tmp_path / "spill"
    proc, channel, log = start_ps(procs, tmp_path, spill, budget=64 << 10)
    tables = TableClient([channel], BOUND_S)
    tables.register("t", 8, ADAGRAD, INIT)
    tables.lookup("t", np.arange(5000, dtype=np.int64))  # most rows on disk
    assert health.check(channel.address, BOUND_S) == "SERVING"
    shutil.rmtree(spill)
    code = proc.wait(BOUND_S)  # it notices within about a second
    channel.close()
    text = log.read_text()
    assert code == SPILL_FAILED_EXIT_CODE, text
    assert "health NOT_SERVING: the spill store failed: spill directory" in text and "was removed" in text, text
    assert "Traceback" not in text, text


@contextlib.contextmanager
def small_disk(tmp_path, size="32m"):
    """A tmpfs of `size` mounted for the test (root only), unmounted after it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(mount):
    """Fill the disk until it has no room left; returns the filler file."""
    filler = mount / "filler"
    with open(filler, "wb") as out:
        with contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * (256 << 10))
                out.flush()
    return filler


def until_the_disk_is_found_full(channel, tables, rng):
    """Look up new ids until one lookup fails for want of room; returns the last batch that
    succeeded (its rows are in memory) and the error."""
    hot = None
    for _ in range(2000):
        ids = np.unique(rng.integers(1 << 40, 1 << 41, 500))
        try:
            tables.lookup("t", ids)
        except ResourceExhaustedError as exc:
            return hot, exc
        hot = ids
    raise AssertionError("the spill store never found its disk full")


def test_while_the_spill_disk_is_full_rows_in_memory_answer_then_writes_resume(procs, tmp_path):
    rng = np.random.default_rng(0)
    with small_disk(tmp_path) as mount:
        proc, channel, log = start_ps(procs, tmp_path, mount / "spill")
        tables = TableClient([channel], BOUND_S)
        tables.register("t", 16, ADAGRAD, INIT)
        filler = fill(mount)
        hot, error = until_the_disk_is_found_full(channel, tables, rng)
        assert "No space left on device" in str(error), error
        assert health.check(channel.address, BOUND_S) == "NOT_SERVING"
        state = described(channel)
        assert state["spill_state"] == "full" and "No space left on device" in state["spill_error"], state
        before = tables.lookup("t", hot)  # rows in memory answer
        push(channel, tables, hot, np.ones((hot.shape[0], 16), np.float32))
        assert (tables.lookup("t", hot) < before).all()  # and take pushes
        filler.unlink()  # room again: RocksDB resumes writing (it looks every few seconds)
        deadline = time.monotonic() + BOUND_S
        while True:
            try:
                tables.lookup("t", np.unique(rng.integers(1 << 41, 1 << 42, 500)))
                break
            except ResourceExhaustedError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.5)
        assert health.check(channel.address, BOUND_S) == "SERVING"
        assert "spill_state" not in described(channel)
        channel.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(BOUND_S) == 0
        assert "Traceback" not in log.read_text(), log.read_text()
        assert [p.name for p in (mount / "spill").iterdir()] == []  # its own subdirectory went


def test_sigterm_of_a_ps_whose_spill_disk_is_full_stops_it_cleanly(procs, tmp_path):
    rng = np.random.default_rng(1)
    with small_disk(tmp_path) as mount:
        proc, channel, log = start_ps(procs, tmp_path, mount / "spill")
        tables = TableClient([channel], BOUND_S)
        tables.register("t", 16, ADAGRAD, INIT)
        fill(mount)
        until_the_disk_is_found_full(channel, tables, rng)
        channel.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(BOUND_S) == 0, log.read_text()
        text = log.read_text()
        assert "Traceback" not in text and "the spill disk is full" in text, text


def test_a_ps_refuses_a_spill_dir_that_is_a_symlink_and_deletes_nothing_behind_it(procs, tmp_path):
    other = tmp_path / "other"  # another user's directory, say, with a directory a PS would name
    (other / "shard-0-0123abcd").mkdir(parents=True)
    (other / "shard-0-0123abcd" / "results.bin").write_bytes(b"theirs")
    os.chown(other / "shard-0-0123abcd", 65534, 65534) if os.geteuid() == 0 else None
    (tmp_path / "spill").symlink_to(other)
    proc, channel, log = start_ps(procs, tmp_path, tmp_path / "spill")
    assert channel is None and proc.returncode != 0
    assert "is a symbolic link" in log.read_text(), log.read_text()
    assert (other / "shard-0-0123abcd" / "results.bin").read_bytes() == b"theirs"
    assert sorted(p.name for p in other.iterdir()) == ["shard-0-0123abcd"]


@pytest.mark.parametrize("recovery", ["partial", "rollback"])
def test_a_run_whose_spill_dir_is_deleted_recovers_the_shard_and_finishes(procs, tmp_path, recovery):
    spill = tmp_path / "spill"
    flags = [
        "--ps",
        "1",
        "--workers",
        "1",
        "--mode",
        "async",
        "--recovery",
        recovery,
        "--drain-grace",
        "1",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "10",
        "--table-memory-budget",
        "65536",
        "--spill-dir",
        str(spill),
    ]
    run = LauncherRun(procs, flags, SCRIPT, ["--steps", "60", "--step-sleep", "0.05"])
    committed = run.wait_for(": committed")
    shutil.rmtree(spill)
    failed = run.wait_for("health NOT_SERVING: the spill store failed", committed)
    assert "was removed" in run.lines[failed], run.output()
    if recovery == "partial":
        restored = run.wait_for("ps0 lost its spill store (exit 74); restoring shard 0 alone", failed)
        back = run.wait_for("ps 0 is back", restored)
    else:
        # the launcher sees the PS exit 74, or a worker that found it gone asks first: either rolls back
        back = run.wait_for("rolling the whole cluster back", failed)
        back = run.wait_for("cluster restarted", back)
    run.wait_for("trained step", back)  # training goes on
    summary = run.finish()
    assert "Traceback" not in run.output(1000)
    if recovery == "partial":
        assert summary["trained"] == 60 and summary["partial_recoveries"][0]["shard"] == 0, summary
    else:
        assert 0 < summary["trained"] < 60, summary  # the restarted worker went on from the checkpoint to the end
