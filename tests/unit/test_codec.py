import struct

import numpy as np
import pytest

from paramserver.base.errors import MalformedFrameError, ProtocolVersionError
from paramserver.wire import codec


def test_round_trip_keeps_meta_names_dtypes_shapes_and_values():
    tensors = [("w", np.arange(12, dtype=np.float32).reshape(3, 4)), ("ids", np.array([5, -7], np.int64)),
               ("empty", np.zeros((0, 3), np.float32)), ("odd", np.arange(3, dtype=np.float16))]
    frame = codec.decode(codec.encode({"step": 7, "tag": "x"}, tensors))
    assert frame.meta == {"step": 7, "tag": "x"}
    assert list(frame.tensors) == ["w", "ids", "empty", "odd"]
    for name, array in tensors:
        assert frame.tensors[name].dtype == array.dtype
        np.testing.assert_array_equal(frame.tensors[name], array)


def test_decoded_arrays_are_read_only_views():
    frame = codec.decode(codec.encode({}, [("w", np.ones(4, np.float32))]))
    with pytest.raises(ValueError):
        frame.tensors["w"][0] = 2.0


def test_parts_join_to_the_same_frame():
    tensors = [("a", np.ones((5, 3), np.float32)), ("b", np.arange(7, dtype=np.int32))]
    parts = codec.encode_parts({"k": 1}, tensors)
    assert b"".join(parts) == codec.encode({"k": 1}, tensors)
    assert codec.parts_size(parts) == len(codec.encode({"k": 1}, tensors))


def _frame_with_header(header: bytes, data: bytes = b"") -> bytes:
    prefix = struct.pack("<4sHHI", codec.MAGIC, codec.PROTOCOL_MAJOR, 0, len(header))
    pad = b"\0" * ((-(len(prefix) + len(header))) % 8)
    return prefix + header + pad + data


@pytest.mark.parametrize("payload, fragment", [
    (b"PSF", "shorter than"),
    (b"XXXX" + b"\0" * 12, "does not start"),
    (struct.pack("<4sHHI", codec.MAGIC, codec.PROTOCOL_MAJOR, 0, 1000), "runs past"),
    (_frame_with_header(b"{not json"), "not valid"),
    (_frame_with_header(b'{"meta": {}, "tensors": [["w", "complex64", [2], 0, 16]]}', b"\0" * 16), "bad tensor"),
    (_frame_with_header(b'{"meta": {}, "tensors": [["w", "float32", [-1], 0, 4]]}', b"\0" * 8), "bad tensor"),
    (_frame_with_header(b'{"meta": {}, "tensors": [["w", "float32", [3], 0, 8]]}', b"\0" * 8), "is not 8 bytes"),
    (_frame_with_header(b'{"meta": {}, "tensors": [["w", "float32", [4], 8, 16]]}', b"\0" * 16), "run past"),
    (_frame_with_header(b'{"meta": [], "tensors": []}'), "must hold"),
])
def test_malformed_frames_are_refused_with_a_reason(payload, fragment):
    with pytest.raises(MalformedFrameError, match=fragment):
        codec.decode(payload)


def test_a_newer_protocol_version_is_refused():
    with pytest.raises(ProtocolVersionError, match=f"protocol {codec.PROTOCOL_MAJOR + 1}"):
        codec.decode(codec.encode({}, major=codec.PROTOCOL_MAJOR + 1))
