"""A worker's data position after a restore comes back with its registration, whatever its model
holds: RegisterTable's reply says it as Register's does, so a model of tables only resumes its data
at the checkpoint's position (not at batch 0). Real shards over the in-process transport, real
checkpoint files."""

import numpy as np
import pytest

from paramserver.checkpoint.files import shard_file
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointStore, checkpoint_name
from paramserver.client.ps_client import PSClient
from paramserver.client.table_client import TableClient
from paramserver.server.shard import Shard
from paramserver.server.shard_service import ShardService
from paramserver.transport.inprocess import InProcessChannel
from paramserver.wire import messages as msg

ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
SGD = {"name": "sgd", "hyper": {"lr": 0.1}}
TIMEOUT = 5.0


def worker(services, model):
    """A worker 0 of `model` ("tables", "dense" or "mixed") registered with `services`."""
    channels = [InProcessChannel(service) for service in services]
    client = PSClient(channels, TIMEOUT, worker=0)
    tables = TableClient(channels, TIMEOUT, worker=0, on_registered=client.record.note_position)
    if model != "dense":
        tables.register("t", 2, ADAGRAD, {"kind": "zeros"})
    values = {"w": np.zeros(3, np.float32)} if model != "tables" else {}
    client.register("g", SGD, values).wait(TIMEOUT)
    return client, tables


def train(client, tables, model, steps):
    """`steps` steps as a PS optimizer sends them: dense gradients and row pushes in one PushPull per shard."""
    for step in range(steps):
        riders = None
        if model != "dense":
            riders = tables.riders()
            ids = np.arange(4 * step, 4 * step + 4, dtype=np.int64)
            riders.push("t", ids, np.full((4, 2), 0.5, np.float32))
        grads = {"w": np.ones(3, np.float32)} if model != "tables" else {}
        client.push_pull(grads, list(grads), riders=riders).wait(TIMEOUT)


def checkpoint(tmp_path, services, step):
    store = CheckpointStore(str(tmp_path))
    name = checkpoint_name(step)
    entries = [shard_file.write(store, name, s.shard, s.shard.tables).__dict__ for s in services]
    store.commit(name, {"step": step, "num_shards": len(services), "shards": entries})
    return RestoreSource(store, name)


@pytest.mark.parametrize("model", ["tables", "dense", "mixed"])
def test_a_worker_resumes_its_data_where_the_restored_checkpoint_left_it_whatever_its_model_holds(tmp_path, model):
    services = [ShardService(Shard(i)) for i in range(2)]
    client, tables = worker(services, model)
    assert (client.record.position, client.record.restored) == (0, 0)  # a fresh start
    train(client, tables, model, 7)

    restore = checkpoint(tmp_path, services, 7)
    restored = [ShardService(Shard(i, restore=restore)) for i in range(2)]
    client, tables = worker(restored, model)
    assert (client.record.position, client.record.restored) == (7, 7), model
    train(client, tables, model, 2)  # a worker restarted into the run later: the pushes since count too
    assert worker(restored, model)[0].record.position == 9, model


def test_a_register_table_reply_says_the_position_the_shard_counts():
    service = ShardService(Shard(0))
    channel = InProcessChannel(service)
    client = PSClient([channel], TIMEOUT, worker=3)
    tables = TableClient([channel], TIMEOUT, worker=3, on_registered=client.record.note_position)
    tables.register("t", 2, ADAGRAD, {"kind": "zeros"})
    train(client, tables, "tables", 4)
    request = msg.RegisterTableRequest(table="t", dim=2, optimizer=ADAGRAD, init={"kind": "zeros"}, worker=3)
    reply, _ = tables.stubs[0].register_table(request, TIMEOUT).wait(TIMEOUT)
    assert reply == msg.RegisterTableReply(position=4, restored=0)
    assert tables.register_again(0, TIMEOUT) == 4  # what partial recovery reads after a shard came back


def test_a_register_table_reply_without_the_position_reads_as_a_fresh_start():
    # a 2.0 PS sends an empty reply: the worker resumes at 0, as it did with that PS
    assert msg.RegisterTableReply.from_meta({}) == msg.RegisterTableReply(position=0, restored=0)
    assert msg.RegisterTableReply(position=5, restored=3).to_meta() == {"position": 5, "restored": 3}
