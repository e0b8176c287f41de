"""The measure of a frame's float32 tensors as they come off the wire, and plain SGD's one C pass."""

import socket
import threading

import numpy as np
import pytest

from paramserver.base import kernels
from paramserver.server.optimizers import SGD
from paramserver.transport.stream import Inbox
from paramserver.wire import codec

pytestmark = pytest.mark.skipif(kernels.KERNELS is None, reason="the C kernels are not built")


def bits(array: np.ndarray) -> int:
    return int((array.view(np.uint32) & 0x7FFFFFFF).max())


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 1000])
def test_max_abs_bits_is_the_largest_magnitude_wherever_it_lies(n):
    rng = np.random.default_rng(n)
    for special in (None, np.nan, np.inf, -np.inf, -3e38):
        for where in {0, n // 2, n - 1}:
            x = rng.standard_normal(n).astype(np.float32)
            if special is not None:
                x[where] = special
            out = np.empty_like(x)
            assert kernels.max_abs_bits(x.ctypes.data, x.nbytes) == bits(x)
            assert kernels.copy_max_abs_bits(x.ctypes.data, out.ctypes.data, x.nbytes) == bits(x)
            assert np.array_equal(out.view(np.uint32), x.view(np.uint32))


def frame() -> bytes:
    grad = np.full(70_001, 0.5, np.float32)
    grad[-1] = np.nan  # the last value of the last float32 tensor
    tensors = [("ids", np.arange(5, dtype=np.int64)), ("ok", np.linspace(-2, 2, 999, dtype=np.float32)), ("g", grad)]
    return codec.encode({"meta": "x" * 5000}, tensors)  # a header longer than a first small read


def check(view: memoryview, data: bytes) -> None:
    assert bytes(view) == data
    tensors = codec.decode(view).tensors
    assert kernels._measured_bits(tensors["ok"]) == bits(tensors["ok"])
    assert not kernels.all_finite(tensors["g"]) and kernels.all_within(tensors["ok"], 2.0)
    assert not kernels.all_within(tensors["ok"], 1.9)
    assert kernels._measured_bits(tensors["ok"][1:]) is None  # only the measured tensor itself


def test_a_frame_copied_out_of_shared_memory_is_copied_exactly_and_measured():
    data = frame()
    inbox = Inbox()
    check(inbox.copy_frame(memoryview(bytearray(data))), data)
    inbox.copy(memoryview(b"\0" * 64))  # the buffer is written again: the figures are gone
    assert not kernels._measured.spans


def test_a_frame_received_over_a_socket_is_measured_piece_by_piece():
    data = frame()
    left, right = socket.socketpair()
    with left, right:
        sender = threading.Thread(target=lambda: [left.sendall(data[i : i + 7919]) for i in range(0, len(data), 7919)])
        sender.start()
        check(Inbox().receive_frame(right, len(data)), data)
        sender.join()


def test_plain_sgd_in_c_rounds_as_numpy(monkeypatch):
    rng = np.random.default_rng(0)
    start, grad = rng.standard_normal(100_003).astype(np.float32), rng.standard_normal(100_003).astype(np.float32)
    fused = start.copy()
    SGD(lr=0.0137).update(fused, grad, {}, 1)
    monkeypatch.setattr(kernels, "KERNELS", None)
    plain = start.copy()
    SGD(lr=0.0137).update(plain, grad, {}, 1)
    assert np.array_equal(fused, plain)
