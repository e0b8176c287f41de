"""Embedding tables on real PS processes: routing by id, bad input over the wire."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tests.conftest import Procs
from tests.ports import free_port

import paramserver as ps
from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task
from paramserver.base.hashing import shard_of
from paramserver.client.ps_client import PSClient
from paramserver.client.table_client import TableClient
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.wire import codec

pytestmark = pytest.mark.cluster  # real PS processes

SGD = {"name": "sgd", "hyper": {"lr": 1.0}}
ZEROS = {"kind": "zeros"}


@pytest.fixture(scope="module")
def shards():
    """Two real PS with table "t" registered, shared by this module's tests: each compares with the
    rows it read itself, so the pushes of the tests before it change none of its verdicts."""
    procs = Procs()
    try:
        addresses = [procs.start_ps(i)[1] for i in range(2)]
        channels = [GrpcChannel(address, 1 << 24) for address in addresses]
        for channel in channels:
            channel.wait_ready(20)
        tables = TableClient(channels, 10)
        tables.register("t", 4, SGD, ZEROS)
        yield channels, tables
        for channel in channels:
            channel.close()
    finally:
        procs.cleanup()


def test_ids_spread_over_shards_and_meet_the_same_rows(shards):
    channels, tables = shards
    ids = np.arange(-500, 500, dtype=np.int64) * 7919
    assert set(shard_of(ids, 2).tolist()) == {0, 1}
    np.testing.assert_array_equal(tables.lookup("t", ids), 0)  # rows made on first touch
    riders = tables.riders()
    riders.push("t", ids, np.tile(ids[:, None].astype(np.float32), (1, 4)))
    PSClient(channels, 10).push_pull({}, [], riders=riders).wait(10)
    rows = tables.lookup("t", ids[::-1].copy())
    np.testing.assert_array_equal(rows[:, 0], -ids[::-1].astype(np.float32))


def call(channel, method, meta, tensors=()):
    return codec.decode(channel.call(method, codec.encode(meta, tensors), 10).wait(10))


@pytest.mark.parametrize("method, meta, tensors, error, fragment", [
    ("Lookup", {"table": "nope"}, [("ids", np.array([1], np.int64))], ps.NotFoundError, "no table 'nope'"),
    ("Lookup", {"table": "t"}, [("ids", np.array([1.0], np.float32))], ps.InvalidArgumentError, "int64"),
    # row pushes and lookups of a PushPull: all checked before anything changes
    ("PushPull", {"pull": [], "rows": [["t", "s.ids", "s.grads"]]},
     [("s.ids", np.array([1, 1], np.int64)), ("s.grads", np.ones((2, 4), np.float32))],
     ps.InvalidArgumentError, "distinct"),
    ("PushPull", {"pull": [], "rows": [["t", "s.ids", "s.grads"]]},
     [("s.ids", np.array([1, 2], np.int64)), ("s.grads", np.ones((3, 4), np.float32))],
     ps.InvalidArgumentError, "does not match 2 ids"),
    ("PushPull", {"pull": [], "rows": [["t", "s.ids", "s.grads"]]},
     [("s.ids", np.array([1], np.int64)), ("s.grads", np.full((1, 4), np.nan, np.float32))],
     ps.InvalidArgumentError, "NaN"),
    ("PushPull", {"pull": [], "rows": [["t", "s.ids", "s.grads"]]}, [("s.ids", np.array([1], np.int64))],
     ps.InvalidArgumentError, "'s.grads'"),
    ("PushPull", {"pull": [], "rows": [["t", "s.ids", "s.grads"]], "lookups": [["nope", "l.ids", "l.rows"]]},
     [("s.ids", np.array([1], np.int64)), ("s.grads", np.ones((1, 4), np.float32)),
      ("l.ids", np.array([5], np.int64))], ps.NotFoundError, "no table 'nope'"),
    ("PushPull", {"pull": [], "rows": [["t", "s.ids", "s.ids"]]},
     [("s.ids", np.array([1], np.int64))], ps.InvalidArgumentError, "names one tensor in two places"),
    ("PushPull", {"pull": [], "lookups": "t"}, [], ps.InvalidArgumentError, "'lookups' must be a list of \\[table, ids, rows\\]"),
])
def test_bad_table_requests_are_refused_and_change_nothing(shards, method, meta, tensors, error, fragment):
    channels, tables = shards
    before = tables.lookup("t", np.array([1, 2], np.int64)).copy()
    rows_before = [call(c, "Hello", {}).meta["tables"]["t"]["rows"] for c in channels]
    with pytest.raises(error, match=fragment):
        for channel in channels:
            call(channel, method, meta, tensors)
    np.testing.assert_array_equal(tables.lookup("t", np.array([1, 2], np.int64)), before)
    assert [call(c, "Hello", {}).meta["tables"]["t"]["rows"] for c in channels] == rows_before


def test_a_table_registered_again_with_another_dim_is_refused(shards):
    _, tables = shards
    with pytest.raises(ps.FailedPreconditionError, match="dim 4"):
        tables.register("t", 8, SGD, ZEROS)


def test_hash_embedding_trains_over_real_shards(procs, fresh_context):
    addresses = [procs.start_ps(i)[1] for i in range(2)]
    cluster = ClusterSpec(ps=tuple(addresses), worker=(f"127.0.0.1:{free_port()}",))
    ps.init(NodeConfig(cluster, Task("worker", 0), Options(connect_timeout_s=20)))
    emb = ps.nn.HashEmbedding(8, std=0.1)
    head = torch.nn.Linear(8, 1)
    opt = ps.optim.Adam(list(emb.parameters()) + list(head.parameters()), lr=0.05)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 10**12, (64,), generator=g)
    target = torch.randn(64, generator=g)
    losses = []
    for _ in range(60):
        opt.zero_grad()
        loss = F.mse_loss(head(emb(ids)).squeeze(1), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


def test_an_id_batch_over_the_configured_maximum_is_refused(procs):
    _, address = procs.start_ps(PARAMSERVER_OPTIONS='{"max_table_ids": 4}')
    channel = GrpcChannel(address, 1 << 20)
    channel.wait_ready(20)
    tables = TableClient([channel], 10)
    tables.register("t", 2, SGD, ZEROS)
    tables.lookup("t", np.arange(4, dtype=np.int64))
    with pytest.raises(ps.InvalidArgumentError, match="5 ids exceed the maximum of 4"):
        tables.lookup("t", np.arange(5, dtype=np.int64))
    assert call(channel, "Hello", {}).meta["tables"]["t"]["rows"] == 4
    channel.close()
