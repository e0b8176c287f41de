"""Gradient codecs: one class in one module each, found by the registry; and the bytes each one puts on
the wire, bit for bit those of the format's reference below (what a 1.x / 2.x peer sends and reads)."""

import importlib
import json
import math
import textwrap

import numpy as np
import pytest

from paramserver.base import codecs, kernels
from paramserver.base.codecs import NONE
from paramserver.base.codecs import parse as parse_codec
from paramserver.base.compression_spec import CompressionSpec
from paramserver.base.config import Options
from paramserver.base.errors import ConfigError, InvalidArgumentError
from paramserver.wire import gradient_codec as gc


# ---- the format's reference: the encoders and decoders as the wire defines them, numpy only ----------
def ref_bf16_bits(values):
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # nearest, ties to even
    rounded[np.isnan(values)] = 0x7FC0
    return rounded


def ref_by_chunk(flat, per_chunk, chunk):
    return (flat.astype(np.float32) * np.repeat(per_chunk, chunk)[: flat.size]).astype(np.float32)


def ref_encode(kind, grad, chunk=1024, ratio=0.0):
    """(header, payload, aux) of float32 `grad`."""
    if kind == "fp16":
        return {"codec": "fp16"}, grad.astype(np.float16), {}
    if kind == "bf16":
        return {"codec": "bf16"}, ref_bf16_bits(grad), {}
    flat = grad.reshape(-1)
    if kind == "int8":
        starts = np.arange(0, flat.size, chunk)
        scales = (np.maximum.reduceat(np.abs(flat), starts) / 127.0).astype(np.float32) if flat.size else flat[:0]
        inverse = np.divide(1.0, scales, out=np.zeros_like(scales), where=scales > 0)
        quantized = np.clip(np.rint(ref_by_chunk(flat, inverse, chunk)), -127, 127).astype(np.int8)
        return {"codec": "int8", "chunk": chunk}, quantized.reshape(grad.shape), {"scale": scales}
    keep = min(flat.size, max(1, math.ceil(ratio * flat.size)))
    index = (
        np.sort(np.argpartition(np.abs(flat), flat.size - keep)[flat.size - keep :])
        if keep < flat.size
        else np.arange(flat.size)
    )
    index = index.astype(np.int32)
    return {"codec": "topk", "shape": list(grad.shape)}, flat[index].astype(np.float32), {"index": index}


def ref_decode(header, payload, aux):
    kind = header["codec"]
    if kind == "fp16":
        return payload.astype(np.float32)
    if kind == "bf16":
        return (payload.astype(np.uint32) << 16).view(np.float32)
    if kind == "int8":
        return ref_by_chunk(payload.reshape(-1), aux["scale"], header["chunk"]).reshape(payload.shape)
    dense = np.zeros(math.prod(header["shape"]), np.float32)
    dense[aux["index"]] = payload
    return dense.reshape(header["shape"])


def awkward(shape=(37, 50), seed=3):
    """Values that test a format: normal, huge, tiny (subnormal), signed zeros, ties, inf and NaN."""
    grad = (np.random.default_rng(seed).standard_normal(shape) * 2).astype(np.float32)
    flat = grad.reshape(-1)
    special = [0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38, 65504.0, 70000.0, 1.00390625, 1.01171875, 1e-3, -7.5]
    flat[: len(special)] = special[: flat.size]
    return grad


NONFINITE = awkward().copy()
NONFINITE.reshape(-1)[20:23] = [np.inf, -np.inf, np.nan]

CASES = [  # (codec text, gradient, chunk)
    ("fp16", awkward(), None),
    ("fp16", NONFINITE, None),
    ("bf16", awkward(), None),
    ("bf16", NONFINITE, None),
    ("bf16", awkward((3, 1000))[:, ::2], None),  # not contiguous
    ("int8", awkward((40, 60)), None),  # 2400 values: two full chunks and a short one
    ("int8", awkward((40, 60)), 60),  # a table's rows: one scale per row
    ("int8", awkward((5, 7)), 6),  # the last chunk short
    ("int8", np.zeros((4, 4), np.float32), None),
    ("topk:0.01", awkward((40, 60)), None),
    ("topk:0.3", np.round(awkward((20, 30))), None),  # many ties
    ("topk:1", awkward((6,)), None),
    ("topk:0.5", np.zeros((0, 3), np.float32), None),
]


@pytest.fixture(params=["kernels", "numpy"])
def both_paths(request, monkeypatch):
    """Each case with the C kernels (where built) and with numpy: both must give the format's bytes."""
    if request.param == "numpy":
        monkeypatch.setattr(kernels, "KERNELS", None)
    elif kernels.KERNELS is None:
        pytest.skip("C kernels not built")


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # fp16: above 65504 is inf, as it should
@pytest.mark.parametrize("text, grad, chunk", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_codec_puts_the_reference_bytes_on_the_wire_and_reads_them_back(both_paths, text, grad, chunk):
    codec = parse_codec(text)
    kind, _, ratio = text.partition(":")
    header, payload, aux = ref_encode(kind, grad, **({"chunk": chunk} if chunk else {}), ratio=float(ratio or 0))
    before = grad.copy()
    encoded = codec.encode(grad, chunk)
    np.testing.assert_array_equal(grad, before)  # the gradient itself is never changed
    assert json.dumps(encoded.header) == json.dumps(header)
    assert (encoded.payload.dtype, encoded.payload.shape) == (payload.dtype, payload.shape)
    assert encoded.payload.tobytes() == payload.tobytes()
    assert list(encoded.aux) == list(aux)
    for key, array in aux.items():
        assert (encoded.aux[key].dtype, encoded.aux[key].tobytes()) == (array.dtype, array.tobytes())
    # a peer's bytes (the reference's) decode to what the reference decodes them to, bit for bit
    request = {"g": payload, **{gc.aux_name("g", key): array for key, array in aux.items()}}
    decoded = gc.decode_tensors(request, {"g": json.loads(json.dumps(header))})
    assert list(decoded) == ["g"] and decoded["g"].dtype == np.float32
    assert decoded["g"].tobytes() == ref_decode(header, payload, aux).tobytes()


# ---- the registry ------------------------------------------------------------------------------------
def test_the_registry_holds_each_codec_of_the_format_as_before():
    table = {
        kind: (np.dtype(c.payload_dtype).name, c.aux, c.error_feedback, c.for_tables)
        for kind, c in codecs.registered().items()
    }
    assert table == {
        "bf16": ("uint16", (), False, True),
        "fp16": ("float16", (), False, True),
        "int8": ("int8", ("scale",), True, True),
        "topk": ("float32", ("index",), True, False),
    }
    assert codecs.usage() == "none, bf16, fp16, int8, topk:R"
    for kind, codec in codecs.registered().items():
        assert codec.__module__ == f"paramserver.base.codecs.{kind}"  # one codec, one module


def test_codec_words_parse_or_are_refused_with_what_is_wrong():
    assert parse_codec(" none ") == NONE and not CompressionSpec.parse("none")
    assert parse_codec("topk:0.25") == parse_codec("topk:.25") and str(parse_codec("topk:0.25")) == "topk:0.25"
    assert str(parse_codec("int8")) == "int8" and CompressionSpec.parse("mlp.*=int8")
    for text, fragment in [
        ("zip", r"unknown compression codec 'zip' \(one of none, bf16, fp16, int8, topk:R\)"),
        ("fp16:3", "takes no argument"),
        ("none:1", "takes no argument"),
        ("topk", "needs a ratio"),
        ("topk:2", r"must be in \(0, 1\]"),
    ]:
        with pytest.raises(InvalidArgumentError, match=fragment):
            parse_codec(text)
        with pytest.raises(ConfigError, match="option 'compression' is not valid"):
            Options(compression=text)
    with pytest.raises(InvalidArgumentError, match="codec none does not encode"):
        NONE.encode(np.zeros(3, np.float32))


def test_a_codec_that_is_not_for_tables_names_the_ones_that_are():
    with pytest.raises(InvalidArgumentError, match=r"table 'emb' takes one of bf16, fp16, int8"):
        CompressionSpec.parse("emb=topk:0.5").codec_for_table("emb")


NEGATE = """
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from paramserver.base.codecs import Codec, Encoded


@dataclass(frozen=True)
class Negated(Codec):
    kind: ClassVar[str] = "negated"
    payload_dtype: ClassVar[np.dtype] = np.dtype(np.float32)
    error_feedback: ClassVar[bool] = True

    def encode(self, grad, chunk=None):
        return Encoded({"codec": self.kind}, -grad)

    @classmethod
    def decode(cls, name, header, payload, aux):
        return -payload
"""


def _package(tmp_path, monkeypatch, name, files):
    root = tmp_path / name
    root.mkdir()
    for file, text in {"__init__.py": "", **files}.items():
        (root / file).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def test_a_codec_is_one_file_of_its_package(tmp_path, monkeypatch):
    package = _package(tmp_path, monkeypatch, "more_codecs", {"negated.py": NEGATE, "_helpers.py": "X = 1\n"})
    found = codecs.discover(package)
    assert list(found) == ["negated"]
    codec = found["negated"]()
    encoded = codec.encode(np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(codec.decode("g", encoded.header, encoded.payload, {}), [0, 1, 2])
    residual = np.ones(3, np.float32)
    codec.residual("g", np.arange(3, dtype=np.float32), encoded, residual)  # the base class's feedback
    np.testing.assert_array_equal(residual, 0)


@pytest.mark.parametrize(
    "name, files, fragment",
    [
        ("no_codec", {"empty.py": "X = 1\n"}, r"no_codec.empty must define one Codec subclass, found 0"),
        ("two_codecs", {"two.py": NEGATE + "\n\nclass Twice(Negated):\n    pass\n"}, "found 2"),
        ("same_kind", {"a.py": NEGATE, "b.py": NEGATE}, "'negated' of same_kind.b is defined twice"),
    ],
)
def test_a_codec_module_written_wrong_is_named(tmp_path, monkeypatch, name, files, fragment):
    with pytest.raises(TypeError, match=fragment):
        codecs.discover(_package(tmp_path, monkeypatch, name, files))
