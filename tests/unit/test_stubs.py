"""The typed stubs are generated from the message tables, and a stub call is one frame each way."""


import numpy as np
import pytest

from paramserver.base.errors import NotFoundError
from paramserver.node.in_process import in_process_shards
from paramserver.wire import messages as msg
from paramserver.wire import stub_gen
from paramserver.wire.calls import gather
from paramserver.wire.stubs import ShardStub

SGD = {"name": "sgd", "hyper": {"lr": 0.5}}


def test_the_stubs_module_is_what_the_generator_writes():
    assert stub_gen.TARGET.read_text() == stub_gen.render()


def test_every_method_of_the_message_tables_has_a_stub():
    for method in msg.SHARD_METHODS:
        assert callable(getattr(ShardStub, stub_gen.snake(method)))


def test_a_step_through_the_stub_returns_the_typed_reply_and_the_rows():
    stub = ShardStub(in_process_shards(1)[0])
    stub.register(msg.RegisterRequest(group="g", optimizer=SGD), 5.0, [("w", np.ones(3, np.float32))]).wait(5.0)
    table = msg.RegisterTableRequest(table="t", dim=2, optimizer=SGD, init={"kind": "zeros"}, num_shards=1)
    stub.register_table(table, 5.0).wait(5.0)
    ids = np.array([4, 9], np.int64)
    stub.lookup(msg.LookupRequest(table="t"), 5.0, [("ids", ids)]).wait(5.0)  # a lookup creates the rows
    request = msg.PushPullRequest(
        rows=[msg.RowPush("t", "r0.ids", "r0.grads")], lookups=[msg.RowLookup("t", "l0.ids", "l0.rows")]
    )
    tensors = [("w", np.full(3, 2.0, np.float32)), ("r0.ids", ids), ("r0.grads", np.ones((2, 2), np.float32)),
               ("l0.ids", ids)]
    ((reply, values),) = gather([stub.push_pull(request, 5.0, tensors)], 5.0)
    assert isinstance(reply, msg.PushPullReply) and reply.applied and reply.version == 1
    np.testing.assert_array_equal(values["w"], np.full(3, 0.0, np.float32))  # 1 - 0.5 * 2
    np.testing.assert_array_equal(values["l0.rows"], np.full((2, 2), -0.5, np.float32))


def test_a_tensor_named_by_two_fields_is_refused_and_changes_nothing():
    stub = ShardStub(in_process_shards(1)[0])
    table = msg.RegisterTableRequest(table="t", dim=2, optimizer=SGD, init={"kind": "zeros"}, num_shards=1)
    stub.register_table(table, 5.0).wait(5.0)
    ids = np.array([4], np.int64)
    request = msg.PushPullRequest(
        rows=[msg.RowPush("t", "x", "r0.grads")], lookups=[msg.RowLookup("t", "x", "l0.rows")]
    )
    with pytest.raises(Exception, match="names one tensor in two places"):
        stub.push_pull(request, 5.0, [("x", ids), ("r0.grads", np.ones((1, 2), np.float32))]).wait(5.0)
    (hello, _), = gather([stub.hello(msg.HelloRequest(), 5.0)], 5.0)
    assert hello.version == 0 and hello.tables["t"]["rows"] == 0


def test_an_unknown_method_is_not_found():
    with pytest.raises(NotFoundError, match="no method 'PushSparse'"):
        in_process_shards(1)[0].call("PushSparse", b"", 5.0).wait(5.0)
