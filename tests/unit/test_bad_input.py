"""Bad input changes nothing: every refusal leaves the shard, its tables and the coordinator as they were."""

import json
import math
import os
import socket
import struct

import numpy as np
import pytest

from paramserver.base.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    MalformedFrameError,
    NotFoundError,
    ResourceExhaustedError,
)
from paramserver.checkpoint import shard_writer
from paramserver.checkpoint.store import CheckpointStore
from paramserver.coordinator.membership import Coordinator
from paramserver.server.shard import Shard
from paramserver.server.shard_service import ShardService
from paramserver.tables.limits import TableLimits
from paramserver.tables.table_store import TableStore
from paramserver.transport import stream as stream_mod
from paramserver.transport import stream_server
from paramserver.transport.shared_memory import Segment
from paramserver.transport.stream_slots import Connection
from paramserver.wire import codec
from paramserver.wire import messages as msg

SGD = {"name": "sgd", "hyper": {"lr": 0.5}}
ROWS = {"name": "adagrad", "hyper": {"lr": 0.1}}
SYNC2 = {"mode": "sync", "workers": 2}


def make_service(checkpoint_dir="", limits=None):
    shard = Shard(0, tables=TableStore(0, limits=limits))
    service = ShardService(shard, save_checkpoint=shard_writer(checkpoint_dir))
    service.call("Register", codec.encode({"group": "g", "optimizer": SGD, "worker": 0, "consistency": SYNC2},
                                          [("w", np.arange(4, dtype=np.float32))]))
    service.call("RegisterTable", codec.encode({"table": "t", "dim": 4, "optimizer": ROWS, "init": {"kind": "zeros"}}))
    return service


def state(service):
    """Everything a refusal must leave alone: counters, mode, tables, groups and the values."""
    hello = codec.decode(service.call("Hello", codec.encode({}))).meta
    values = codec.decode(service.call("PushPull", codec.encode({"pull": ["w"]}))).tensors["w"].copy()
    groups = Shard.snapshot(service.shard, lambda groups, *_: sorted(groups))  # the class's: a test may spy on it
    return json.dumps(hello, sort_keys=True), groups, values.tobytes()


def refused(service, method, meta, tensors=(), error=Exception, match=""):
    before = state(service)
    with pytest.raises(error, match=match):
        service.call(method, codec.encode(meta, tensors))
    assert state(service) == before


# ---- checkpoints: no path from the wire ------------------------------------------------------------
@pytest.mark.parametrize("name", ["../ckpt-000000001", "/tmp/ckpt-000000001", "memory://x", "ftp://host/x",
                                  "ckpt-1", "ckpt-000000001/../../x", ""])
def test_a_checkpoint_name_that_is_not_one_is_refused_before_any_snapshot(tmp_path, name):
    service = make_service(str(tmp_path / "own"))
    snapshots = []
    service.shard.snapshot = lambda read: snapshots.append(read)  # any snapshot taken would show here
    refused(service, "Checkpoint", {"name": name}, error=InvalidArgumentError, match="not a checkpoint name")
    assert snapshots == [] and not (tmp_path / "own").exists() and sorted(os.listdir(tmp_path)) == []


def test_a_checkpoint_is_written_under_the_ps_own_directory_whatever_the_request_says(tmp_path):
    service = make_service(str(tmp_path / "own"))
    other = tmp_path / "other"
    reply = codec.decode(service.call("Checkpoint", codec.encode({"dir": str(other), "name": "ckpt-000000001"})))
    assert msg.CheckpointReply.from_meta(reply.meta).file == "shard-0.safetensors"
    assert (tmp_path / "own" / "ckpt-000000001" / "shard-0.safetensors").is_file() and not other.exists()


def test_a_committed_checkpoint_is_never_overwritten(tmp_path):
    service = make_service(str(tmp_path))
    store = CheckpointStore(str(tmp_path))
    entry = msg.CheckpointReply.from_meta(codec.decode(service.call(
        "Checkpoint", codec.encode({"name": "ckpt-000000001"}))).meta).to_meta()
    store.commit("ckpt-000000001", {"step": 1, "num_shards": 1, "shards": [entry]})
    files = {p.name: p.read_bytes() for p in (tmp_path / "ckpt-000000001").iterdir()}
    service.call("Lookup", codec.encode({"table": "t"}, [("ids", np.arange(5, dtype=np.int64))]))  # rows change
    snapshots = []
    service.shard.snapshot = lambda read: snapshots.append(read)
    refused(service, "Checkpoint", {"name": "ckpt-000000001"}, error=AlreadyExistsError, match="never overwritten")
    assert snapshots == [] and {p.name: p.read_bytes() for p in (tmp_path / "ckpt-000000001").iterdir()} == files


def checkpoint_call(service, name):
    return service.call("Checkpoint", codec.encode({"name": name}))


def test_far_future_checkpoint_names_cost_one_file_which_the_next_checkpoint_removes(tmp_path):
    service = make_service(str(tmp_path))
    for step in range(999_999_980, 1_000_000_000):  # 20 names far ahead of any step, as fast as they come
        checkpoint_call(service, f"ckpt-{step:09d}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-999999999"]  # each replaced the one before
    checkpoint_call(service, "ckpt-000000010")  # the chief's real one: the stray never committed goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000010"]


def test_a_checkpoint_name_behind_the_sequence_is_refused_audited_and_changes_nothing(tmp_path):
    from paramserver.base.config import Options
    from paramserver.security.auth import SHARD_ACTIONS, Guard
    from paramserver.transport.dispatch import answer as dispatch

    audit = tmp_path / "audit.jsonl"
    directory = tmp_path / "ckpt"
    service = make_service(str(directory))
    service.guard = Guard.from_options(Options(audit_log=str(audit)), "ps-0", SHARD_ACTIONS)
    store = CheckpointStore(str(directory))
    entry = msg.CheckpointReply.from_meta(codec.decode(checkpoint_call(service, "ckpt-000000020")).meta).to_meta()
    store.commit("ckpt-000000020", {"step": 20, "num_shards": 1, "shards": [entry]})
    checkpoint_call(service, "ckpt-000000030")  # the next one (not committed yet)
    before, files = state(service), sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))
    answer = dispatch(service, "Checkpoint", codec.encode({"name": "ckpt-000000015"}), "ipv4:127.0.0.1:9")
    assert answer.code.name == "FAILED_PRECONDITION" and "behind the sequence" in answer.reply
    assert state(service) == before and sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) == files
    service.guard.close()
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [(r["what"], r["outcome"]) for r in records if r["what"] == "Checkpoint"][-1] == (
        "Checkpoint", "FAILED_PRECONDITION")


def test_a_ps_without_a_checkpoint_dir_refuses_checkpoints():
    refused(make_service(""), "Checkpoint", {"name": "ckpt-000000001"}, error=FailedPreconditionError,
            match="checkpoint_dir")


# ---- refused requests change nothing -----------------------------------------------------------------
def test_a_push_whose_pull_names_an_unknown_variable_applies_nothing():
    refused(make_service(), "PushPull", {"worker": 0, "pull": ["w", "nope"]}, [("w", np.ones(4, np.float32))],
            NotFoundError, "nope")


def test_a_push_whose_lookup_would_pass_the_row_limit_applies_nothing():
    service = make_service(limits=TableLimits(max_rows=2000))
    ids = np.arange(3000, dtype=np.int64)
    refused(service, "PushPull", {"worker": 0, "lookups": [["t", "ids", "rows"]]},
            [("w", np.ones(4, np.float32)), ("ids", ids)], ResourceExhaustedError, "max_table_rows")


@pytest.mark.parametrize("meta, tensors, match", [
    ({"group": "h", "optimizer": SGD, "worker": 5}, [("v", np.ones(2, np.float32))], "outside"),
    ({"group": "h", "optimizer": SGD, "worker": -1}, [("v", np.ones(2, np.float32))], "negative"),
    ({"group": "h", "optimizer": SGD, "worker": 0}, [], "at least one variable"),
    ({"group": "h", "optimizer": SGD, "worker": 0}, [("v", np.array([1, np.nan], np.float32))], "NaN"),
    ({"group": "h", "optimizer": SGD, "worker": 0, "consistency": {"mode": "sync", "workers": 3}},
     [("v", np.ones(2, np.float32))], "mode"),
])
def test_a_refused_registration_creates_no_group(meta, tensors, match):
    refused(make_service(), "Register", meta, tensors, match=match)


# ---- forged calls ------------------------------------------------------------------------------------
def test_set_mode_with_a_worker_count_that_contradicts_the_cluster_is_refused():
    refused(make_service(), "SetMode", {"consistency": {"mode": "sync", "workers": 7}}, error=FailedPreconditionError,
            match="contradicts")


@pytest.mark.parametrize("lr", [-1.0, 1e400, "NaN"])
def test_a_push_lr_must_be_a_finite_non_negative_number(lr):
    meta = codec.encode({"worker": 0}, [("w", np.ones(4, np.float32))])
    # NaN and 1e400 cannot even be written as JSON a frame accepts: patch the header's text
    payload = meta.replace(b'{"worker":0}', json.dumps({"worker": 0, "lr": {"g": lr}}).encode()
                           .replace(b'"NaN"', b"NaN").ljust(len(b'{"worker":0}')))
    service = make_service()
    before = state(service)
    with pytest.raises(InvalidArgumentError):
        service.call("PushPull", codec.encode({"worker": 0, "lr": {"g": lr}}, [("w", np.ones(4, np.float32))])
                     if isinstance(lr, float) and math.isfinite(lr) else payload)
    assert state(service) == before


@pytest.mark.parametrize("step", [-1, 1 << 63, 1.5, True])
def test_a_heartbeat_step_must_be_a_non_negative_int64(step):
    coordinator = Coordinator(2)
    coordinator.join(0)
    before = coordinator.view()
    with pytest.raises(InvalidArgumentError, match="step"):
        coordinator.heartbeat(0, step)
    assert coordinator.view() == before


@pytest.mark.parametrize("wait", [math.nan, math.inf, -1.0, 61.0, 1e9])
def test_a_barrier_wait_outside_0_to_60_s_is_refused_at_once(wait):
    coordinator = Coordinator(2)
    with pytest.raises(InvalidArgumentError, match="barrier wait"):
        coordinator.barrier("b", 0, wait)
    assert coordinator.barrier("b", 1, 0.0)["waiting"] == [0]  # worker 0 never arrived


def test_a_burst_of_checkpoint_requests_is_one_pending_request():
    coordinator = Coordinator(2)
    for _ in range(50):
        coordinator.request_checkpoint(1)
    assert coordinator.view()["checkpoints_requested"] == 1
    for worker in (0, 1):
        coordinator.barrier("checkpoint#1", worker, 0.0)  # the workers met for it...
    coordinator.request_checkpoint(0)
    assert coordinator.view()["checkpoints_requested"] == 1  # ...but it is not written yet: the same state
    for worker in (0, 1):
        coordinator.barrier("checkpoint#1:written", worker, 0.0)  # written: the next one may come
    coordinator.request_checkpoint(0)
    coordinator.request_checkpoint(0)
    assert coordinator.view()["checkpoints_requested"] == 2


# ---- frames and fields ---------------------------------------------------------------------------------
def _frame(header: bytes, data: bytes = b"") -> bytes:
    pad = (-(12 + len(header))) % 8
    return struct.pack("<4sHHI", b"PSFR", codec.PROTOCOL_MAJOR, 0, len(header)) + header + b"\0" * pad + data


@pytest.mark.parametrize("header, match", [
    (b'{"meta": ' + b"[" * 100000 + b"]" * 100000 + b', "tensors": []}', "nested too deeply"),
    (b'{"meta": {"x": NaN}, "tensors": []}', "NaN"),
    (b'{"meta": {}, "tensors": [["a", ["float32"], [1], 0, 4]]}', "bad tensor entry"),
    (b'{"meta": {}, "tensors": [["a", "float32", [0, 9223372036854775807, 9223372036854775807], 0, 0]]}',
     "not valid"),
    (b'{"meta": {}, "tensors": [["a", "float32", [1], 99999999999999999999999, 4]]}', "bad tensor entry"),
    (b'{"meta": {}, "tensors": [["a", "uint8", [0], 0, 0], ["a", "uint8", [0], 0, 0]]}', "twice"),
    (b'{"meta": {}, "tensors": [["a", "float32", [1], 4, 4]]}', "aligned"),
    (b'{"meta": {}, "tensors": [["a", "float32", ' + b"[1]" * 0 + b"[" + b"1," * 40 + b"1], 0, 4]]}",
     "bad tensor entry"),
])
def test_malformed_frames_are_malformed_frame_errors(header, match):
    with pytest.raises(MalformedFrameError, match=match):
        codec.decode(_frame(header, b"\0" * 16))


@pytest.mark.parametrize("meta, match", [
    ({"worker": 0, "step": 1 << 63}, "int64"), ({"worker": -(1 << 63) - 1}, "int64"),
    ({"worker": 0, "lr": {"g": 1e308 * 10}}, "must be"),
])
def test_fields_out_of_the_int64_or_finite_range_are_refused(meta, match):
    with pytest.raises(MalformedFrameError, match=match):
        msg.PushPullRequest.from_meta(meta)


# ---- table limits --------------------------------------------------------------------------------------
def test_a_refused_table_registration_does_not_set_the_mode():
    service = ShardService(Shard(0, tables=TableStore(0, limits=TableLimits(max_rows=10_000))))
    with pytest.raises(ResourceExhaustedError):
        service.call("RegisterTable", codec.encode({"table": "t", "dim": 4, "optimizer": ROWS, "init": {"kind": "zeros"},
                                                    "capacity": 1 << 20, "consistency": SYNC2}))
    assert service.shard.spec is None and service.tables.describe() == {}


def test_a_table_capacity_past_the_row_limit_is_refused_before_memory_is_taken():
    store = TableStore(0, limits=TableLimits(max_rows=10_000))
    with pytest.raises(ResourceExhaustedError, match="max_table_rows"):
        store.register("t", 4, ROWS, {"kind": "zeros"}, capacity=1 << 30)
    assert store.describe() == {}


def test_tables_past_the_ps_memory_limit_are_refused():
    store = TableStore(0, limits=TableLimits(max_bytes=4 << 20))
    store.register("a", 64, ROWS, {"kind": "zeros"}, capacity=4096)  # 4096 x (64 x 8 + 32) bytes: about 2.2 MB
    with pytest.raises(ResourceExhaustedError, match="max_table_memory_bytes"):
        store.register("b", 64, ROWS, {"kind": "zeros"}, capacity=4096)
    with pytest.raises(ResourceExhaustedError, match="max_table_memory_bytes"):
        store.lookup("a", np.arange(10_000, dtype=np.int64))
    assert sorted(store.describe()) == ["a"] and store.describe()["a"]["rows"] == 0
    assert store.lookup("a", np.arange(100, dtype=np.int64)).shape == (100, 64)  # within the limit: served


def test_lookups_create_rows_up_to_the_row_limit_only():
    store = TableStore(0, limits=TableLimits(max_rows=1500))
    store.register("t", 4, ROWS, {"kind": "zeros"})
    store.lookup("t", np.arange(1000, dtype=np.int64))
    with pytest.raises(ResourceExhaustedError, match="1502 rows"):
        store.lookup("t", np.arange(999, 1500 + 2, dtype=np.int64))
    assert store.describe()["t"]["rows"] == 1000
    store.lookup("t", np.arange(500, 1500, dtype=np.int64))  # existing rows and new ones up to the limit
    assert store.describe()["t"]["rows"] == 1500


def test_a_row_policy_of_wrong_types_is_an_invalid_argument():
    store = TableStore(0)
    with pytest.raises(InvalidArgumentError, match="row policy"):
        store.register("t", 4, ROWS, {"kind": "zeros"}, policy={"max_rows": "9"})
    assert store.describe() == {}


# ---- the stream: memory taken as bytes arrive; shared memory sealed and copied ---------------------------
def test_a_declared_size_is_not_allocated_before_the_bytes_arrive():
    inbox, (ours, theirs) = stream_mod.Inbox(), socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"x" * 100)
        theirs.close()
        with pytest.raises(ConnectionError):
            inbox.receive(ours, 1 << 30)
    assert inbox.capacity <= stream_mod.FIRST_CHUNK


def test_a_sealed_segment_cannot_shrink():
    segment, spec = Segment.create(1 << 16)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(spec["fd"], 16)
        attached = Segment.attach(spec)
        attached.close()
    finally:
        segment.close()


class Recorder:
    """A service that records whether the payload it was given lies in the segment."""

    def __init__(self, segment):
        self.segment, self.in_segment = segment, []

    def decode(self, method, payload):
        base = np.frombuffer(self.segment.view, np.uint8)
        self.in_segment.append(np.shares_memory(np.frombuffer(payload, np.uint8), base))
        return method

    def serve(self, request, sink):
        return sink(codec.encode_parts({}))


def test_a_request_in_shared_memory_is_copied_out_before_the_service_sees_it():
    segment, _ = Segment.create(1 << 16)
    server = stream_server.StreamServer(None, "127.0.0.1", 0, 1 << 20)
    server.service = recorder = Recorder(segment)
    request = codec.encode({})
    segment.requests[:len(request)] = request
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(struct.pack("<4sBBHQ", b"PSTS", stream_mod.REQUEST_SHM, 0, 0, len(request)))
        state = Connection(ours, "test", 10.0)
        server.slots.arrive(state)  # accepted, pending until its first message
        state.segment = segment
        assert server.serve_one(ours, "test", stream_mod.Inbox(), state)
        assert recorder.in_segment == [False]
    finally:
        ours.close()
        theirs.close()
        server.stop(1)
        segment.close()


def test_the_new_refusals_come_back_as_their_own_types():
    import grpc

    from paramserver.base.errors import error_for_status

    assert isinstance(error_for_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "x"), ResourceExhaustedError)
    assert isinstance(error_for_status(grpc.StatusCode.ALREADY_EXISTS, "x"), AlreadyExistsError)


# ---- names, optimizer arguments, gradient magnitudes and dense memory from the wire ---------------------
ONE = [("v", np.ones(2, np.float32))]
TABLE = {"dim": 2, "optimizer": ROWS, "init": {"kind": "zeros"}}


@pytest.mark.parametrize("method, meta, tensors, match", [
    ("Register", {"group": "\ud800", "optimizer": SGD}, ONE, "lone surrogate"),
    ("RegisterTable", {"table": "t\udfff", **TABLE}, (), "lone surrogate"),
    ("Register", {"group": "a\nb", "optimizer": SGD}, ONE, "control characters"),
    ("RegisterTable", {"table": "x" * 257, **TABLE}, (), "1 to 256 characters"),
    ("RegisterTable", {"table": "", **TABLE}, (), "1 to 256 characters"),
])
def test_a_name_that_is_not_printable_utf8_is_malformed_and_changes_nothing(method, meta, tensors, match):
    refused(make_service(), method, meta, tensors, MalformedFrameError, match)


@pytest.mark.parametrize("optimizer, match", [
    ({"name": "adam", "hyper": [1, 2]}, "hyper must be an object"),
    ({"name": "adam", "hyper": "lr"}, "hyper must be an object"),
    ({"name": "sgd", "hyper": {"lr": "0.1"}}, "'lr' must be a number"),
    ({"name": "adam", "hyper": {"betas": "ab"}}, "'betas' must be a pair of numbers"),
    ({"name": "adam", "hyper": {"amsgrad": [True]}}, "'amsgrad' must be true or false"),
])
@pytest.mark.parametrize("method", ["Register", "RegisterTable"])
def test_optimizer_arguments_of_the_wrong_kind_are_invalid_never_internal(method, optimizer, match):
    if method == "Register":
        meta, tensors = {"group": "h", "optimizer": optimizer}, ONE
    else:
        meta, tensors = {"table": "u", **TABLE, "optimizer": optimizer}, ()
    if method == "RegisterTable" and "amsgrad" in str(optimizer):
        match = "unknown arguments"  # a table's Adam has no amsgrad at all
    refused(make_service(), method, meta, tensors, InvalidArgumentError, match)


@pytest.mark.parametrize("bound", [None, 10.0])
def test_a_gradient_above_the_bound_is_refused_like_nan_dense_and_rows(bound):
    limits = TableLimits() if bound is None else TableLimits(max_gradient=bound)
    service = make_service(limits=limits)
    big = 1e30 if bound is None else 11.0
    refused(service, "PushPull", {"worker": 0}, [("w", np.array([0, big, 0, 0], np.float32))], InvalidArgumentError,
            "values above")
    ids = np.arange(3, dtype=np.int64)
    service.call("Lookup", codec.encode({"table": "t"}, [("ids", ids)]))
    rows = service.shard.tables.lookup("t", ids).copy()
    refused(service, "PushPull", {"worker": 0, "rows": [["t", "ids", "g"]]},
            [("ids", ids), ("g", np.full((3, 4), -big, np.float32))], InvalidArgumentError, "values above")
    np.testing.assert_array_equal(service.shard.tables.lookup("t", ids), rows)
    ok = 1e14 if bound is None else 9.0  # under the bound: accepted
    group = service.shard.snapshot(lambda groups, *_: groups["g"])
    assert group.gradient("w", np.array([0, -ok, 0, 0], np.float32), limits.max_gradient)[1] == -ok
    assert service.shard.tables.check_push("t", ids, np.full((3, 4), ok, np.float32)).grads[0, 0] == ok


def test_a_dense_registration_past_the_memory_limit_is_refused_before_it_takes_memory():
    service = make_service(limits=TableLimits(max_bytes=1 << 20))
    adam = {"name": "adam", "hyper": {"lr": 0.1}}  # values + 2 states: 3 x 128 KiB x 3 > 1 MiB
    big = [(f"v{i}", np.zeros(32768, np.float32)) for i in range(3)]
    refused(service, "Register", {"group": "big", "optimizer": adam}, big, ResourceExhaustedError,
            "max_table_memory_bytes")
    service.call("Register", codec.encode({"group": "small", "optimizer": adam}, big[:1]))
    assert "small" in service.shard.snapshot(lambda groups, *_: groups)
