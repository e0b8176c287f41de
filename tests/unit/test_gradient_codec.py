"""Compressed gradients: encode/decode round trips, error feedback, and bad encodings refused by the shard."""

import json

import numpy as np
import pytest
import torch

from paramserver.base.codecs import NONE
from paramserver.base.codecs import parse as parse_codec
from paramserver.base.compression_spec import CompressionSpec
from paramserver.base.errors import InvalidArgumentError
from paramserver.client.compression import GradientCompressor
from paramserver.client.table_client import TableClient
from paramserver.server.shard import Shard
from paramserver.server.shard_service import ShardService
from paramserver.wire import codec
from paramserver.wire import gradient_codec as gc
from paramserver.wire.half import bf16_bits_to_float32

FP16, BF16, INT8, TOPK = (parse_codec(text) for text in ("fp16", "bf16", "int8", "topk:0.01"))


def gradient(shape=(300, 70), seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def round_trip(codec_, grad, chunk=None):
    encoded = codec_.encode(grad, chunk)
    return encoded, gc.decode_tensors(dict(encoded.tensors("g")), {"g": encoded.header})


# ---- casts --------------------------------------------------------------------------------------
def test_fp16_and_bf16_are_the_casts_torch_makes_at_half_the_bytes():
    grad = gradient()
    for codec_, dtype in ((FP16, torch.float16), (BF16, torch.bfloat16)):
        encoded, decoded = round_trip(codec_, grad)
        np.testing.assert_array_equal(decoded["g"], torch.from_numpy(grad).to(dtype).float().numpy())
        assert decoded["g"].dtype == np.float32 and encoded.nbytes * 2 == grad.nbytes


@pytest.mark.parametrize("chunk", [1024, 70, 7])
def test_int8_is_within_half_a_step_of_each_chunk_scale(chunk):
    grad = gradient(scale=3.0)
    grad[5, :] *= 100  # one large row: its chunk's scale must not coarsen the others
    encoded, decoded = round_trip(INT8, grad, chunk)
    scales = encoded.aux["scale"]
    assert scales.shape == (-(-grad.size // chunk),) and encoded.payload.dtype == np.int8
    step = np.repeat(scales, chunk)[: grad.size].reshape(grad.shape)
    assert (np.abs(decoded["g"] - grad) <= step * 0.5 + 1e-6 * np.abs(grad)).all()
    assert encoded.nbytes == grad.size + 4 * scales.size


def test_topk_keeps_exactly_the_largest_values_and_zeroes_the_rest():
    grad = gradient()
    encoded, decoded = round_trip(TOPK, grad)
    kept = int(np.ceil(0.01 * grad.size))
    order = np.argsort(-np.abs(grad.reshape(-1)))
    np.testing.assert_array_equal(np.sort(encoded.aux["index"]), np.sort(order[:kept]))
    flat = decoded["g"].reshape(-1)
    np.testing.assert_array_equal(flat[order[:kept]], grad.reshape(-1)[order[:kept]])
    assert np.count_nonzero(flat) == kept and encoded.nbytes == kept * 8


def test_empty_and_zero_gradients_round_trip():
    for codec_ in (FP16, BF16, INT8, TOPK):
        for grad in (np.zeros((0, 4), np.float32), np.zeros((3, 4), np.float32)):
            np.testing.assert_array_equal(round_trip(codec_, grad)[1]["g"], grad)


# ---- error feedback -----------------------------------------------------------------------------
@pytest.mark.parametrize("codec_", [INT8, TOPK], ids=str)
def test_error_feedback_makes_the_decoded_sum_track_the_true_sum(codec_):
    compressor = GradientCompressor()
    compressor.add("v", codec_, (40, 50))
    true_sum, sent_sum, plain_sum = (np.zeros((40, 50), np.float64) for _ in range(3))
    for step in range(300):
        grad = gradient((40, 50), seed=step) + 0.05  # a bias that plain truncation would lose
        header, tensors = compressor.encode("v", "v", grad)
        sent_sum += gc.decode_tensors(dict(tensors), {"v": header})["v"]
        plain_sum += round_trip(codec_, grad)[1]["g"]
        true_sum += grad
    residual = compressor.residuals["v"]
    np.testing.assert_allclose(sent_sum + residual, true_sum, atol=1e-3)  # nothing lost, only delayed
    assert np.abs(residual).max() < (0.1 if codec_.kind == "int8" else 30)  # bounded, not growing with steps
    assert np.abs(sent_sum - true_sum).mean() < 0.5 * np.abs(plain_sum - true_sum).mean()


def test_error_feedback_of_a_split_variable_keeps_each_part_residual():
    compressor = GradientCompressor()
    compressor.add("v", INT8, (10, 300))
    grad = gradient((10, 300))
    for rows in (slice(0, 4), slice(4, 10)):
        compressor.encode("v", "v", grad[rows], rows)
    whole = GradientCompressor()
    whole.add("v", INT8, (10, 300))
    expected = np.concatenate(
        [grad[:4] - round_trip(INT8, grad[:4])[1]["g"], grad[4:] - round_trip(INT8, grad[4:])[1]["g"]]
    )
    np.testing.assert_allclose(compressor.residuals["v"], expected, atol=1e-7)
    assert np.abs(compressor.residuals["v"]).max() > 0


def test_casts_keep_no_residual_and_the_bytes_are_counted_as_encoded():
    compressor = GradientCompressor()
    compressor.add("a", FP16, (100,))
    compressor.add("b", NONE, (100,))
    grad = gradient((100,))
    compressor.encode("a", "a", grad)
    compressor.encode("b", "b", grad)
    assert compressor.residuals == {} and compressor.gradient_bytes == 200 + 400


def test_table_rows_take_one_int8_scale_per_row():
    compressor = GradientCompressor()
    rows = gradient((50, 16))
    header, tensors = compressor.encode_rows(INT8, "s0.grads", rows)
    assert header == {"codec": "int8", "chunk": 16} and dict(tensors)[gc.aux_name("s0.grads", "scale")].shape == (50,)


# ---- which codec: rules ------------------------------------------------------------------------
def test_tables_skip_topk_rules_and_one_naming_a_table_is_refused():
    spec = CompressionSpec.parse("mlp.*=topk:0.01,*=int8")
    assert str(spec.codec_for("mlp.0.weight")) == "topk:0.01" and spec.codec_for_table("mlp.emb").kind == "int8"
    assert CompressionSpec.parse("topk:0.1").codec_for_table("ctr.embedding").kind == "none"
    with pytest.raises(InvalidArgumentError, match="topk compresses dense gradients only"):
        CompressionSpec.parse("ctr.embedding=topk:0.1").codec_for_table("ctr.embedding")
    with pytest.raises(InvalidArgumentError, match="topk"):
        TableClient([], 1.0).register("t", 4, {}, {}, compression=TOPK)


# ---- the shard: decoded before anything, bad encodings change nothing ---------------------------
SGD = {"name": "sgd", "hyper": {"lr": 1.0}}
ROWS = {"name": "sgd", "hyper": {"lr": 1.0}}


@pytest.fixture
def service():
    service = ShardService(Shard(0))
    service.call("Register", codec.encode({"group": "g", "optimizer": SGD}, [("w", np.zeros((4, 300), np.float32))]))
    service.call("RegisterTable", codec.encode({"table": "t", "dim": 4, "optimizer": ROWS, "init": {"kind": "zeros"}}))
    state(service)  # the rows exist from here on: a lookup creates them
    return service


def state(service):
    hello = codec.decode(service.call("Hello", codec.encode({}))).meta
    w = codec.decode(service.call("PushPull", codec.encode({"pull": ["w"]}))).tensors["w"].copy()
    rows = codec.decode(service.call("Lookup", codec.encode({"table": "t"}, [("ids", np.arange(3))]))).tensors
    return json.dumps(hello, sort_keys=True), w.tobytes(), rows["rows"].tobytes()


def push(service, codecs, tensors):
    meta = {"codecs": codecs, "rows": [["t", "s0.ids", "s0.grads"]]}
    return codec.decode(service.call("PushPull", codec.encode(meta, [("s0.ids", np.arange(3)), *tensors])))


def test_the_shard_applies_the_decoded_gradients_dense_and_rows(service):
    w, rows = gradient((4, 300)), gradient((3, 4), seed=1)
    dense, row_codec = INT8.encode(w), BF16.encode(rows)
    reply = push(
        service,
        {"w": dense.header, "s0.grads": row_codec.header},
        [*dense.tensors("w"), *row_codec.tensors("s0.grads")],
    )
    decoded = gc.decode("w", dense.header, dense.payload, dense.aux)
    np.testing.assert_array_equal(reply.tensors["w"], -decoded)
    looked_up = codec.decode(service.call("Lookup", codec.encode({"table": "t"}, [("ids", np.arange(3))])))
    np.testing.assert_array_equal(looked_up.tensors["rows"], -bf16_bits_to_float32(row_codec.payload))


def _int8(grad):
    return INT8.encode(grad)


BAD = [
    ("unknown codec", lambda e: ({"w": {"codec": "int4"}}, e.tensors("w")), "unknown encoding"),
    (
        "wrong scale count",
        lambda e: ({"w": e.header}, [("w", e.payload), ("~w.scale", e.aux["scale"][:1])]),
        "needs 2 float32 scales",
    ),
    (
        "NaN scale",
        lambda e: ({"w": e.header}, [("w", e.payload), ("~w.scale", np.array([1, np.nan], np.float32))]),
        "NaN",
    ),
    ("scale missing", lambda e: ({"w": e.header}, [("w", e.payload)]), "needs tensor '~w.scale'"),
    ("wrong payload dtype", lambda e: ({"w": {"codec": "fp16"}}, [("w", e.payload)]), "float16"),
    ("bad chunk", lambda e: ({"w": {"codec": "int8", "chunk": 0}}, e.tensors("w")), "chunk"),
    ("no such tensor", lambda e: ({"x": {"codec": "fp16"}}, e.tensors("w")), "does not carry"),
    (
        "index out of range",
        lambda e: (
            {"w": {"codec": "topk", "shape": [4, 300]}},
            [("w", np.ones(2, np.float32)), ("~w.index", np.array([5, 1200], np.int32))],
        ),
        r"within \[0, 1200\)",
    ),
    (
        "index repeated",
        lambda e: (
            {"w": {"codec": "topk", "shape": [4, 300]}},
            [("w", np.ones(2, np.float32)), ("~w.index", np.array([5, 5], np.int32))],
        ),
        "strictly increasing",
    ),
    (
        "topk shape wrong",
        lambda e: (
            {"w": {"codec": "topk", "shape": [3, 300]}},
            [("w", np.ones(1, np.float32)), ("~w.index", np.array([5], np.int64))],
        ),
        "shape",
    ),
    (
        "decodes to inf",
        lambda e: ({"w": {"codec": "fp16"}}, [("w", np.full((4, 300), np.inf, np.float16))]),
        "infinite",
    ),
]


@pytest.mark.parametrize("case, build, fragment", BAD, ids=[case for case, _, _ in BAD])
def test_a_bad_encoding_is_refused_and_changes_nothing(service, case, build, fragment):
    before = state(service)
    codecs, tensors = build(_int8(gradient((4, 300))))
    rows = INT8.encode(gradient((3, 4)))  # a good row push in the same request: not applied either
    with pytest.raises(InvalidArgumentError, match=fragment):
        push(service, {**codecs, "s0.grads": rows.header}, [*tensors, *rows.tensors("s0.grads")])
    assert state(service) == before
