"""A real PS process over gRPC and the tensor stream: numbers, bad input, unreachable servers."""

import json
import os
import socket
import struct
import time

import grpc
import numpy as np
import pytest
import torch
from tests.conftest import Procs
from tests.reference import batches, max_relative_error, mlp, train, twin

import paramserver as ps
from paramserver.base.config import ClusterSpec, NodeConfig, Options, Task
from paramserver.client.ps_client import PSClient
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.wire import codec

pytestmark = pytest.mark.cluster  # real PS processes

TRANSPORTS = {"shm": dict(use_stream=True, shared_memory=True), "tcp": dict(use_stream=True, shared_memory=False),
              "grpc": dict(use_stream=False)}


def join(addresses, **options):
    cluster = ClusterSpec(ps=tuple(addresses), worker=("127.0.0.1:0",))
    return ps.init(NodeConfig(cluster, Task("worker", 0), Options(connect_timeout_s=20, **options)))


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_training_over_two_real_ps_equals_torch(procs, fresh_context, transport):
    addresses = [procs.start_ps(i)[1] for i in range(2)]
    join(addresses, split_bytes=4096, **TRANSPORTS[transport])
    reference = mlp()
    model = twin(reference)
    data = batches(100)
    train(reference, torch.optim.Adam(reference.parameters(), lr=1e-3), data)
    opt = ps.optim.Adam(model.parameters(), lr=1e-3)
    train(model, opt, data)
    assert max_relative_error(model, reference) < 1e-5
    assert {p.shard for parts in opt.context.client.parts_of.values() for p in parts} == {0, 1}


def test_overlap_mode_trains_on_parameters_one_update_old(procs, fresh_context):
    join([procs.start_ps()[1]])
    model = mlp()
    opt = ps.optim.SGD(model.parameters(), lr=0.1, overlap=True)
    x, y = batches(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    # after two steps only the first update was loaded; pull() brings in the second
    after_two = [p.detach().clone() for p in model.parameters()]
    opt.pull()
    assert not all(torch.equal(a, b) for a, b in zip(before, after_two))
    assert not all(torch.equal(a, p) for a, p in zip(after_two, model.parameters()))


@pytest.fixture(scope="module")
def remote():
    """A real PS with one registered group, and a raw channel to it per transport. Shared by this
    module's tests: each compares with the values and version it pulled itself, so the pushes of the
    tests before it change none of its verdicts."""
    procs = Procs()
    try:
        _, address = procs.start_ps()
        channels = {}
        for name, opts in TRANSPORTS.items():
            channel = GrpcChannel(address, 1 << 30, opts["use_stream"], opts.get("shared_memory", False))
            channel.wait_ready(20)
            channels[name] = channel
        initial = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "b": np.zeros(2, np.float32)}
        call(channels["grpc"], "Register", codec.encode({"group": "g", "optimizer": {"name": "sgd",
                                                                                      "hyper": {"lr": 1}}},
                                                        initial.items()))
        yield channels
        for channel in channels.values():
            channel.close()
    finally:
        procs.cleanup()


def call(channel, method, payload):
    return codec.decode(channel.call(method, payload, 10).wait(10))


def pull(channel):
    frame = call(channel, "PushPull", codec.encode({"pull": ["w", "b"]}))
    return frame.meta["version"], {k: v.copy() for k, v in frame.tensors.items()}


BAD_PUSHES = [
    ("wrong shape", codec.encode({}, [("w", np.ones((2, 3), np.float32))]), ps.InvalidArgumentError, "shape"),
    ("wrong dtype", codec.encode({}, [("w", np.ones((3, 2), np.float64))]), ps.InvalidArgumentError, "dtype"),
    ("unknown variable", codec.encode({}, [("v", np.ones(2, np.float32))]), ps.NotFoundError, "'v'"),
    ("NaN", codec.encode({}, [("b", np.array([0, np.nan], np.float32))]), ps.InvalidArgumentError, "NaN"),
    ("malformed frame", b"PSFR" + codec.PROTOCOL_MAJOR.to_bytes(2, "little") + b"\x00\x00\xff\xff\x00\x00garbage",
     ps.InvalidArgumentError, "runs past"),
    ("not a frame", b"hello", ps.InvalidArgumentError, "shorter"),
    ("newer protocol", codec.encode({}, [("b", np.ones(2, np.float32))], major=codec.PROTOCOL_MAJOR + 1),
     ps.FailedPreconditionError, f"protocol {codec.PROTOCOL_MAJOR + 1}"),
]


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("case, payload, error, fragment", BAD_PUSHES, ids=[c[0] for c in BAD_PUSHES])
def test_bad_pushes_get_a_clear_error_and_change_nothing(remote, transport, case, payload, error, fragment):
    channel = remote[transport]
    version, before = pull(channel)
    with pytest.raises(error, match=fragment):
        call(channel, "PushPull", payload)
    after_version, after = pull(channel)  # the PS still serves, on the same connection
    assert after_version == version
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    good = call(channel, "PushPull", codec.encode({}, [("b", np.ones(2, np.float32))]))
    assert good.meta["version"] == version + 1
    np.testing.assert_array_equal(good.tensors["b"], before["b"] - 1)


def test_unknown_method_on_grpc_is_a_clear_error(remote):
    with pytest.raises(ps.ParamServerError):
        call(remote["grpc"], "Explode", codec.encode({}))


def test_unreachable_ps_is_a_typed_error_within_the_deadline(procs):
    _, address = procs.start_ps()
    procs.cleanup()  # the PS is gone; nothing listens on its port now
    client = PSClient([GrpcChannel(address, 1 << 20)], rpc_timeout_s=1)
    started = time.monotonic()
    with pytest.raises(ps.UnavailableError, match=address):
        client.connect(timeout=1.5)
    assert time.monotonic() - started < 5


def test_a_ps_killed_mid_training_is_a_typed_error(procs, fresh_context):
    proc, address = procs.start_ps()
    join([address], rpc_timeout_s=3)
    model = mlp()
    opt = ps.optim.Adam(model.parameters())
    data = batches(2)
    train(model, opt, data[:1])
    proc.kill()
    proc.wait()
    with pytest.raises(ps.UnavailableError):
        train(model, opt, data[1:])


def _stream_port(address):
    channel = GrpcChannel(address, 1 << 20, use_stream=False)
    try:
        return call(channel, "Hello", codec.encode({})).meta["stream_port"]
    finally:
        channel.close()


def _attach(address, spec):
    with socket.create_connection(("127.0.0.1", _stream_port(address)), timeout=10) as sock:
        body = json.dumps(spec).encode()
        sock.sendall(struct.pack("<4sBBHQ", b"PSTS", 4, 0, 0, len(body)) + body)
        _, kind, status, _, size = struct.unpack("<4sBBHQ", sock.recv(16, socket.MSG_WAITALL))
        return status, sock.recv(size, socket.MSG_WAITALL).decode()


def test_the_stream_refuses_to_attach_files_that_are_not_sealed_segments(procs, tmp_path):
    _, address = procs.start_ps()
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 4096)
    unsealed = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 4096)
    with open(victim, "r+b") as file:
        refused = {"path": _attach(address, {"path": str(victim), "capacity": 1024}),
                   "a file's fd": _attach(address, {"pid": os.getpid(), "fd": file.fileno(), "capacity": 1024}),
                   "unsealed memfd": _attach(address, {"pid": os.getpid(), "fd": unsealed, "capacity": 1024})}
    os.close(unsealed)
    assert refused["path"][0] == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "pid, fd" in refused["path"][1]
    for status, reason in (refused["a file's fd"], refused["unsealed memfd"]):
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "not a sealed memory file" in reason
    assert victim.read_bytes() == b"x" * 4096


def test_garbage_on_the_stream_closes_that_connection_only(remote, procs):
    address = remote["grpc"].address
    with socket.create_connection(("127.0.0.1", _stream_port(address)), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        try:
            assert sock.recv(16) == b""  # closed by the PS...
        except ConnectionResetError:
            pass  # ...or reset, as it closed with our bytes unread
    version, _ = pull(remote["tcp"])
    assert call(remote["tcp"], "PushPull", codec.encode({}, [("b", np.ones(2, np.float32))])).meta["version"] == \
        version + 1


def test_sync_bad_pushes_over_the_wire(procs):
    """In sync mode: a worker outside the cluster, a repeated step, a step from the future, a late step."""
    _, address = procs.start_ps()
    channel = GrpcChannel(address, 1 << 20)
    channel.wait_ready(20)
    sync = {"mode": "sync", "workers": 2, "backups": 1, "staleness": 0}
    call(channel, "Register", codec.encode({"group": "g", "optimizer": {"name": "sgd", "hyper": {"lr": 1}},
                                            "consistency": sync}, [("b", np.zeros(2, np.float32))]))

    def push(worker, step, value=1.0):
        return call(channel, "PushPull", codec.encode({"worker": worker, "step": step},
                                                      [("b", np.full(2, value, np.float32))]))
    with pytest.raises(ps.InvalidArgumentError, match="worker 7 is outside"):
        push(7, 0)
    with pytest.raises(ps.FailedPreconditionError, match="pushed step 3"):
        push(0, 3)
    reply = push(0, 0)  # quorum is 1 (2 workers, 1 backup): applied at once
    assert reply.meta["applied"] and reply.meta["step"] == 1
    late = push(1, 0, value=1000.0)  # the backup's step 0 came late: dropped, counted
    assert not late.meta["applied"]
    np.testing.assert_array_equal(late.tensors["b"], [-1, -1])
    stats = call(channel, "Hello", codec.encode({})).meta
    assert (stats["dropped_late"], stats["sync_step"], stats["version"]) == (1, 1, 1)
    channel.close()


def test_two_large_param_groups_both_adopt_the_first_workers_values(procs, fresh_context):
    """Registration replies over 1 MiB are views into the stream's buffer: each must be read in turn."""
    address = procs.start_ps()[1]
    first, second = mlp(seed=0, sizes=(784, 512, 10)), mlp(seed=1, sizes=(784, 512, 10))
    for model in (first, second):
        ctx = join([address])
        ps.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1)
        ctx.shutdown()
    assert max_relative_error(second, first) == 0.0


def test_overlap_mode_with_an_embedding_matches_the_same_run_without_overlap_replies(procs, fresh_context):
    """In overlap mode, lookups go out while a large dense reply waits to be read: it must stay intact."""
    address = procs.start_ps()[1]
    join([address])
    torch.manual_seed(0)
    emb = ps.nn.HashEmbedding(4, std=0.1)
    dense = torch.nn.Linear(784, 512)  # a reply over 1 MiB
    opt = ps.optim.SGD(list(emb.parameters()) + list(dense.parameters()), lr=0.0, overlap=True)
    before = dense.weight.detach().clone()
    for step in range(5):
        opt.zero_grad()
        (dense(torch.randn(2, 784)).sum() + emb(torch.tensor([step, step + 100])).sum()).backward()
        opt.step()
    opt.pull()
    assert torch.equal(dense.weight, before)  # lr 0: every reply must carry the unchanged values


def test_a_large_reply_stays_valid_when_the_next_call_goes_out_before_it_is_read(procs):
    """One call is in flight per stream: a new call reads the previous reply first, as a copy."""
    _, address = procs.start_ps()
    channel = GrpcChannel(address, 1 << 30, use_stream=True, use_shared_memory=True)
    channel.wait_ready(20)
    big = {"w": np.arange(3 << 20, dtype=np.float32), "v": -np.arange(3 << 20, dtype=np.float32)}  # 12 MB each
    call(channel, "Register", codec.encode({"group": "g", "optimizer": {"name": "sgd", "hyper": {"lr": 1}}},
                                           big.items()))
    first = channel.call("PushPull", codec.encode({"pull": ["w"]}), 10)
    second = channel.call("PushPull", codec.encode({"pull": ["v"]}), 10)  # same buffers for its reply
    np.testing.assert_array_equal(codec.decode(second.wait(10)).tensors["v"], big["v"])
    np.testing.assert_array_equal(codec.decode(first.wait(10)).tensors["w"], big["w"])
    channel.close()
