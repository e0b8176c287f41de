"""gRPC, the tensor stream (TCP and shared memory) and the in-process twin answer every request alike: the same reply
bytes, the same error class and message, and INTERNAL (the server still serving) for a bug."""

import re

import numpy as np
import pytest

import paramserver as ps
from paramserver.base.config import Options
from paramserver.node.ps_node import PSNode
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.transport.inprocess import InProcessChannel
from paramserver.wire import codec

SGD = {"name": "sgd", "hyper": {"lr": 1.0}}
KINDS = ("grpc", "tcp", "shm", "inprocess")


@pytest.fixture(scope="module")
def channels():
    """One PS node served in this process, and a channel of each kind to the same service."""
    node = PSNode("127.0.0.1:0", 0, Options())
    address = node.start()
    made = {"grpc": GrpcChannel(address, 1 << 26, use_stream=False),
            "tcp": GrpcChannel(address, 1 << 26, use_stream=True, use_shared_memory=False),
            "shm": GrpcChannel(address, 1 << 26, use_stream=True, use_shared_memory=True),
            "inprocess": InProcessChannel(node.service)}
    for channel in made.values():
        channel.wait_ready(20)
    made["inprocess"].call("Register", codec.encode({"group": "g", "optimizer": SGD},
                                                    [("w", np.arange(4, dtype=np.float32))]), 10).wait(10)
    yield node, made
    for channel in made.values():
        channel.close()
    node.stop(1.0)


def outcome(channel, method: str, payload: bytes):
    """(reply bytes, None) or (None, (error class, message without the caller's address))."""
    try:
        return bytes(channel.call(method, payload, 10).wait(10)), None
    except ps.ParamServerError as exc:
        return None, (type(exc), re.sub(r"^\S+ " + method + ": ", "", str(exc)))


REQUESTS = [
    ("pull", "PushPull", codec.encode({"pull": ["w"]})),
    ("wrong shape", "PushPull", codec.encode({}, [("w", np.ones(3, np.float32))])),
    ("unknown variable", "PushPull", codec.encode({}, [("v", np.ones(2, np.float32))])),
    ("NaN gradient", "PushPull", codec.encode({}, [("w", np.array([0, np.nan, 0, 0], np.float32))])),
    ("malformed frame", "PushPull",
     b"PSFR" + codec.PROTOCOL_MAJOR.to_bytes(2, "little") + b"\x00\x00\xff\xff\x00\x00garbage"),
    ("unknown table", "Lookup", codec.encode({"table": "t"}, [("ids", np.arange(3, dtype=np.int64))])),
    ("bad mode", "SetMode", codec.encode({"consistency": {"mode": "bulk"}})),
    ("newer protocol", "PushPull", codec.encode({"pull": ["w"]}, major=codec.PROTOCOL_MAJOR + 1)),
]


@pytest.mark.parametrize("method, payload", [r[1:] for r in REQUESTS], ids=[r[0] for r in REQUESTS])
def test_every_transport_gives_the_same_answer(channels, method, payload):
    _, made = channels
    answers = {kind: outcome(made[kind], method, payload) for kind in KINDS}
    assert len({answers[kind] for kind in KINDS}) == 1, answers


def test_a_bug_in_the_service_is_internal_on_every_transport_and_the_server_goes_on(channels, monkeypatch):
    node, made = channels
    monkeypatch.setitem(node.service.methods, "Lookup", lambda payload, sink: 1 / 0)
    answers = {kind: outcome(made[kind], "Lookup", codec.encode({"table": "t"})) for kind in KINDS}
    assert len({answers[kind] for kind in KINDS}) == 1, answers
    reply, (error, message) = answers["grpc"]
    assert reply is None and error is ps.ParamServerError and "INTERNAL" in message
    pulled = {kind: outcome(made[kind], "PushPull", codec.encode({"pull": ["w"]})) for kind in KINDS}
    assert pulled["grpc"][0] is not None and len({pulled[kind] for kind in KINDS}) == 1
