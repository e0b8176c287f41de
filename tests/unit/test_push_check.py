"""A push's gradient is checked (NaN, infinities, max_gradient_magnitude) by the copy that takes it off the
wire: over TCP and shared memory the check reads nothing again, and a refused push still changes nothing."""

import numpy as np
import pytest

import paramserver as ps
from paramserver.base import kernels
from paramserver.base.config import Options
from paramserver.node.ps_node import PSNode
from paramserver.transport.grpc_transport import GrpcChannel
from paramserver.wire import codec

ROWS, DIM, BOUND = 512, 16, 1e6
KINDS = {"tcp": {"use_shared_memory": False}, "shm": {"use_shared_memory": True}}


@pytest.fixture(scope="module")
def node():
    options = Options(max_gradient_magnitude=BOUND)
    node = PSNode("127.0.0.1:0", 0, options)
    address = node.start()
    channels = {kind: GrpcChannel(address, 1 << 26, use_stream=True, **how) for kind, how in KINDS.items()}
    for channel in channels.values():
        channel.wait_ready(20)
    yield channels
    for channel in channels.values():
        channel.close()
    node.stop(1.0)


def pull(channel, name: str) -> np.ndarray:
    return codec.decode(bytes(channel.call("PushPull", codec.encode({"pull": [name]}), 10).wait(10))).tensors[name]


@pytest.mark.skipif(kernels.KERNELS is None, reason="the C kernels are not built")
@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_value_in_the_last_row_refuses_the_push_and_changes_nothing(node, kind, monkeypatch):
    channel = node[kind]
    name = f"w_{kind}"
    start = np.linspace(-1, 1, ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
    channel.call("Register", codec.encode({"group": name, "optimizer": {"name": "sgd", "hyper": {"lr": 0.5}}},
                                          [(name, start)]), 10).wait(10)
    measured = []
    check = kernels._measured_bits
    monkeypatch.setattr(kernels, "_measured_bits", lambda array: measured.append(check(array)) or measured[-1])
    for bad in (np.nan, np.inf, -2 * BOUND):
        grad = np.full((ROWS, DIM), 0.25, np.float32)
        grad[-1, -1] = bad
        with pytest.raises(ps.InvalidArgumentError, match="NaN or infinite"):
            channel.call("PushPull", codec.encode({}, [(name, grad)]), 10).wait(10)
        assert np.array_equal(pull(channel, name), start)
    grad = np.full((ROWS, DIM), 0.25, np.float32)
    grad[-1, -1] = -BOUND  # at the bound: taken
    channel.call("PushPull", codec.encode({}, [(name, grad)]), 10).wait(10)
    assert np.array_equal(pull(channel, name), start + grad * np.float32(-0.5))
    # every check was answered by the figure the copy off the wire measured, none by a second pass
    assert len(measured) == 4 and None not in measured
