"""A tiered table's checkpoint is its state: a PS killed (-9) while rows move between memory and
disk loses nothing the checkpoint holds; the checkpoint restores onto two tiered PS (resharded)
and exports, all equal to the values at the checkpoint. The spill files are only a cache."""

import json
import os
import random
import signal
import threading

import numpy as np
import pytest
from tests.wait import finished

from paramserver.base.hashing import shard_of
from paramserver.checkpoint import tools
from paramserver.checkpoint.store import CheckpointStore
from paramserver.client.ps_client import PSClient
from paramserver.client.table_client import TableClient
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.wire import codec

pytestmark = pytest.mark.fault  # kill -9 of a PS process

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
INIT = {"kind": "normal", "std": 0.1}
IDS = np.arange(30_000, dtype=np.int64) * 7919 + 3
BOUND_S = 60


def start(procs, index, directory, spill, resume=False):
    options = {"table_memory_budget": 256 << 10, "spill_dir": str(spill), "checkpoint_dir": str(directory),
               "resume": resume}
    proc, address = procs.start_ps(index=index, PARAMSERVER_OPTIONS=json.dumps(options))
    channel = GrpcChannel(address, 1 << 26)
    channel.wait_ready(BOUND_S)
    return proc, channel


def train(channel, tables, rng, steps):
    for _ in range(steps):
        ids = rng.choice(IDS, 3000, replace=False)
        tables.lookup("t", ids)
        riders = tables.riders()
        riders.push("t", ids, rng.standard_normal((ids.shape[0], 16)).astype(np.float32))
        PSClient([channel], BOUND_S).push_pull({}, [], riders=riders).wait(BOUND_S)


def test_a_ps_killed_while_rows_move_between_tiers_resumes_from_its_checkpoint_on_two_ps(procs, tmp_path):
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    directory, spill = tmp_path / "ckpt", tmp_path / "spill"
    proc, channel = start(procs, 0, directory, spill)
    tables = TableClient([channel], BOUND_S)
    tables.register("t", 16, ADAGRAD, INIT)
    tables.lookup("t", IDS)  # 30k rows, most of them on disk
    train(channel, tables, rng, 10)
    entry = codec.decode(channel.call("Checkpoint", codec.encode({"name": "ckpt-000000010"}), BOUND_S).wait(BOUND_S))
    CheckpointStore(str(directory)).commit("ckpt-000000010", {"step": 10, "num_shards": 1,
                                                              "shards": [entry.meta]})
    saved = tables.lookup("t", IDS)  # reads create nothing: every id has its row
    busy_rng = np.random.default_rng(seed + 1)
    busy = threading.Thread(target=lambda: _train_until_killed(channel, tables, busy_rng), name="busy-trainer")
    busy.start()
    threading.Event().wait(rng.uniform(0.05, 1.0))  # mid-training: rows are written back to disk
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(BOUND_S)
    finished(busy, "the training thread to see its PS gone")
    channel.close()
    assert any(spill.iterdir()), f"seed {seed}"  # what the killed PS left: ignored, then deleted at the next start

    channels = [start(procs, index, directory, spill, resume=True)[1] for index in range(2)]
    both = TableClient(channels, BOUND_S)  # rows by shard_of(id, 2): a restored PS holds only its own
    both.register("t", 16, ADAGRAD, INIT)
    np.testing.assert_array_equal(both.lookup("t", IDS), saved, err_msg=f"seed {seed}")
    rows = [codec.decode(c.call("Hello", codec.encode({}), BOUND_S).wait(BOUND_S)).meta["tables"]["t"]["rows"]
            for c in channels]
    assert rows == [int((shard_of(IDS, 2) == index).sum()) for index in range(2)], f"seed {seed}"
    for other in channels:
        other.close()
    exported = tools.load_export(tools.export(str(directory), None, str(tmp_path / "model.safetensors")))
    order = np.argsort(exported["embeddings"]["t"]["ids"].numpy())
    at = order[np.searchsorted(exported["embeddings"]["t"]["ids"].numpy()[order], IDS)]
    np.testing.assert_array_equal(exported["embeddings"]["t"]["weight"].numpy()[at], saved, err_msg=f"seed {seed}")


def _train_until_killed(channel, tables, rng):
    try:
        train(channel, tables, rng, 1000)
    except Exception:  # the PS was killed: any error of the client ends it
        return

