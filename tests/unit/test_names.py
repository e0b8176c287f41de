"""One rule for names (base/names.py): what the frame codec and the message decoding let through is
exactly what a checkpoint file holds and reads back (shard_meta's schema, safetensors' own reader)."""

import json
import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from paramserver.base import names
from paramserver.base.errors import InvalidArgumentError, MalformedFrameError
from paramserver.checkpoint.files import shard_meta, tensor_file
from paramserver.checkpoint.store import CheckpointError
from paramserver.wire import codec
from paramserver.wire import messages as msg
from paramserver.wire.calls import decode_request

SGD = {"name": "sgd", "hyper": {"lr": 0.5}}
TABLE = {"dim": 2, "optimizer": {"name": "adagrad", "hyper": {"lr": 0.1}}, "init": {"kind": "zeros"}}
ONE = [("v", np.ones(2, np.float32))]

GOOD = ["g", "opt0.group0", "fc.weight[0:3]", "a b", "héllo", "表", "\U0001f600", "x" * names.MAX_CHARS, "-", "[", "~a"]
BAD = {
    "": "1 to 256 characters",
    "x" * (names.MAX_CHARS + 1): "1 to 256 characters",
    "a/b": "'/'",
    "/": "'/'",
    "\x00": "control characters",
    "a\x00b": "control characters",
    "a\nb": "control characters",
    "\t": "control characters",
    "\x1f": "control characters",
    "a\x7f": "control characters",
    "a\x80": "control characters",
    "a\x85": "control characters",
    "a\x9f": "control characters",
    "a\u2028b": "control characters",
    "a\u2029": "control characters",
    "a\u202eb": "control characters",
    "a\u2066": "control characters",
    "\ud800x": "lone surrogate",
    "x\udfff": "lone surrogate",
    "\udc80": "lone surrogate",
}


# ---- the rule itself ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", GOOD, ids=ascii)
def test_a_name_of_printable_text_without_a_slash_is_one(name):
    assert names.name_problem(name) is None
    assert names.check_name(name, "group") == name


@pytest.mark.parametrize("name, why", BAD.items(), ids=ascii)
def test_a_name_that_a_checkpoint_cannot_hold_is_refused_saying_why(name, why):
    assert why in names.name_problem(name)
    with pytest.raises(InvalidArgumentError, match=rf"^table .*{why}.*got ") as refused:
        names.check_name(name, "table")
    assert str(refused.value).isascii()  # the value is shown escaped: a control character prints as \x00


@pytest.mark.parametrize("value", [None, 3, b"g", ["g"]])
def test_a_name_is_a_string(value):
    assert "must be a string" in names.name_problem(value)


def test_text_inside_a_spec_may_hold_a_slash_but_nothing_a_name_may_not():
    assert names.strings_problem({"name": "adam", "hyper": {"lr": 0.1, "betas": [0.9, 0.99], "note": "a/b"}}) is None
    assert "control characters" in names.strings_problem({"name": "adam", "hyper": {"x": "a\x00"}})
    assert "['hyper']['x']" in names.strings_problem({"name": "adam", "hyper": {"x": "a\x00"}})
    assert "key" in names.strings_problem({"hyper": {"\ud800": 1}})
    assert "lone surrogate" in names.strings_problem(["ok", ["\udfff"]])
    assert "1 to 256" in names.strings_problem({"kind": "x" * 257})
    deep: list = []
    for _ in range(names.MAX_DEPTH + 2):
        deep = [deep]
    assert "levels deep" in names.strings_problem(deep)


@pytest.mark.parametrize(
    "parts, why",
    [
        ({"w[0:2]": (2, 3), "w[2:5]": (3, 3), "b": (4,)}, None),
        ({"w[4:9]": (5,)}, None),  # a shard holds any rows of a variable; the others hold the rest
        ({"x[0:3]": (3,)}, None),
        ({"w[0:2]": (3,)}, "names rows 0..2"),
        ({"w[2:2]": (0,)}, "names rows 2..2"),
        ({"w[3:1]": (2,)}, "names rows 3..1"),
        ({"w[0:1]": ()}, "names rows 0..1"),
        ({"w[0:3]": (3,), "w[2:4]": (2,)}, "overlap"),
        ({"w": (3,), "w[0:3]": (3,)}, "overlap"),
        ({"w/x": (3,)}, "'/'"),
        ({"w\x00": (3,)}, "control characters"),
    ],
)
def test_parts_must_fit_the_rows_their_names_say_and_never_overlap(parts, why):
    found = names.parts_problem(parts)
    assert found is None if why is None else why in found, found


@pytest.mark.parametrize(
    "name, ok",
    [
        ("ckpt-000000001", True),
        ("ckpt-999999999", True),
        ("ckpt-1", False),
        ("ckpt-000000001\n", False),
        ("ckpt-00000000\u0661", False),
        ("../ckpt-000000001", False),
        ("", False),
        (None, False),
        ("ckpt-0000000001", False),
    ],
)
def test_a_checkpoint_name_is_ckpt_and_nine_ascii_digits(name, ok):
    assert (names.checkpoint_name_problem(name) is None) is ok


@pytest.mark.parametrize(
    "method, meta, tensors",
    [
        ("Register", {"group": "g", "optimizer": SGD}, ONE),
        ("RegisterTable", {"table": "t", **TABLE}, []),
        ("PushPull", {}, ONE),
        ("Assign", {}, ONE),
    ],
)
def test_a_worker_index_past_what_a_checkpoint_names_is_refused(method, meta, tensors):
    assert decode(method, {**meta, "worker": names.MAX_WORKER}, tensors).message.worker == names.MAX_WORKER
    with pytest.raises(MalformedFrameError, match=f"^{method} request: 'worker' must be at most 999999999"):
        decode(method, {**meta, "worker": names.MAX_WORKER + 1}, tensors)


# ---- the frame codec: strict UTF-8 --------------------------------------------------------------------
def raw_frame(meta, tensors=(), swap=(b"", b"")):
    """codec.encode(meta, tensors) with the header's bytes `swap[0]` replaced by `swap[1]` (bytes
    json.dumps would never write: raw surrogates, invalid UTF-8)."""
    payload = codec.encode(meta, list(tensors))
    magic, major, minor, length = struct.unpack_from("<4sHHI", payload)
    end = 12 + length
    header = payload[12:end].replace(*swap) if swap[0] else payload[12:end]
    data = payload[end + (-end % 8) :]
    return struct.pack("<4sHHI", magic, major, minor, len(header)) + header + b"\0" * (-(12 + len(header)) % 8) + data


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"\xed\xa0\x80", "lone surrogate's bytes"),
        (b"\xed\xbf\xbf", "lone surrogate's bytes"),
        (b"\xed\xa0\xbd\xed\xb8\x80", "lone surrogate's bytes"),  # a pair as CESU-8 writes it: not UTF-8 either
        (b"\xff", "not UTF-8 text"),
        (b"\xc0\xaf", "not UTF-8 text"),  # an overlong '/'
        (b"\xe2\x82", "not UTF-8 text"),
        (b"\xf4\x90\x80\x80", "not UTF-8 text"),  # past U+10FFFF
    ],
)
@pytest.mark.parametrize("where", ["value", "key", "tensor name"])
def test_a_header_that_is_not_strict_utf8_is_malformed_wherever_the_bytes_are(raw, why, where):
    meta = {"group": "@@", "optimizer": SGD} if where != "key" else {"group": "g", "@@": 1, "optimizer": SGD}
    tensors = [("@@" if where == "tensor name" else "v", np.ones(2, np.float32))]
    payload = raw_frame(meta, tensors, (b'"@@"', b'"' + raw + b'"'))
    with pytest.raises(MalformedFrameError, match=f"not UTF-8 text.*{why}" if "surrogate" in why else why):
        codec.decode(payload)
    with pytest.raises(MalformedFrameError):
        codec.decode_meta(payload)


@pytest.mark.parametrize("escape", [r"\ud800", r"\udfff", r"x\uDC00", r"\ud83d"])
def test_an_escaped_lone_surrogate_is_malformed_too(escape):
    payload = raw_frame({"group": "@@", "optimizer": SGD}, ONE, (b"@@", escape.encode()))
    with pytest.raises(MalformedFrameError, match="lone surrogate"):
        codec.decode(payload)


def test_utf8_text_raw_or_escaped_decodes_to_the_same_name():
    raw = raw_frame({"group": "@@", "optimizer": SGD}, ONE, (b"@@", "é表😀".encode()))
    escaped = raw_frame({"group": "@@", "optimizer": SGD}, ONE, (b"@@", rb"\u00e9\u8868\ud83d\ude00"))
    assert codec.decode(raw).meta["group"] == codec.decode(escaped).meta["group"] == "é表😀"


# ---- decoding of Register, RegisterTable and Checkpoint --------------------------------------------
def decode(method, meta, tensors=()):
    return decode_request("shard service", msg.SHARD_METHODS, method, codec.encode(meta, list(tensors)))


@pytest.mark.parametrize("name, why", BAD.items(), ids=ascii)
@pytest.mark.parametrize("field", ["group", "part", "table", "optimizer", "init", "policy"])
def test_every_name_a_registration_brings_obeys_the_rule(field, name, why):
    if name in ("a/b", "/") and field in ("optimizer", "init", "policy"):
        return  # text inside a spec may hold '/': it is not part of a tensor's name
    if field in ("group", "part", "optimizer"):
        meta = {"group": name if field == "group" else "g", "optimizer": SGD}
        if field == "optimizer":
            meta["optimizer"] = {"name": "sgd", "hyper": {"lr": 0.5, name: name}}
        tensors = [(name if field == "part" else "v", np.ones(2, np.float32))]
        method = "Register"
    else:
        meta, tensors, method = {"table": name if field == "table" else "t", **TABLE}, [], "RegisterTable"
        if field in ("init", "policy"):
            meta[field] = {"kind": "zeros", "note": name} if field == "init" else {name: 1}
    if "surrogate" in why:  # the frame codec refuses it first, saying where
        match = "^frame header holds a lone surrogate .*in " + re.escape(SURROGATE_AT[field])
    else:
        match = f"^{method} request: .*{why}"
    with pytest.raises(MalformedFrameError, match=match) as refused:
        decode(method, meta, tensors)
    named = {"part": "part ", "optimizer": "'optimizer'", "init": "'init'", "policy": "'policy'"}
    assert ("['tensors'][0][0]" if field == "part" and "surrogate" in why else named.get(field, f"'{field}'")) in str(
        refused.value
    )


SURROGATE_AT = {
    "group": "['meta']['group']",
    "part": "['tensors'][0][0]",
    "table": "['meta']['table']",
    "optimizer": "a key of ['meta']['optimizer']['hyper']",
    "init": "['meta']['init']['note']",
    "policy": "a key of ['meta']['policy']",
}


def test_a_split_part_that_does_not_hold_its_rows_is_refused_at_register():
    with pytest.raises(MalformedFrameError, match=r"part 'w\[0:3\]' names rows 0..3 .* shape \(2,\)"):
        decode("Register", {"group": "g", "optimizer": SGD}, [("w[0:3]", np.ones(2, np.float32))])
    ok = decode("Register", {"group": "g", "optimizer": SGD}, [("w[3:5]", np.ones(2, np.float32))])
    assert list(ok.tensors) == ["w[3:5]"]


@pytest.mark.parametrize("field", ["name", "parent"])
@pytest.mark.parametrize("value", ["ckpt-000000001\n", "ckpt-00000000\u0661", "ckpt-1", "../ckpt-000000001", "\x00"])
def test_a_checkpoint_request_names_a_checkpoint(field, value):
    meta = {"name": "ckpt-000000002", field: value}
    with pytest.raises(MalformedFrameError, match=f"'{field}' is not a checkpoint name"):
        decode("Checkpoint", meta)
    assert decode("Checkpoint", {"name": "ckpt-000000002", "parent": "ckpt-000000001"}).message.parent


# ---- the reader holds the same rule: what decodes, a checkpoint holds and reads back ------------------
def shard_file(tmp_path, group, part, table):
    """A real shard file with group `group`, part `part` and table `table`; its path and metadata text."""
    meta = {
        "shard": 0,
        "groups": {group: {"spec": SGD, "steps": {part: 1}}},
        "tables": {table: {"dim": 2, "spec": TABLE["optimizer"], "counters": {}, "steps": 0, "rows": 1}},
        "positions": {"0": 1},
    }
    arrays = {
        f"dense/{group}/{part}": np.ones(2, np.float32),
        f"table/{table}/ids": np.array([7], np.int64),
        f"table/{table}/values": np.ones((1, 2), np.float32),
        f"table/{table}/accum": np.zeros((1, 2), np.float32),
    }
    text = json.dumps(meta)
    layout = tensor_file.plan({key: (a.dtype, a.shape) for key, a in arrays.items()}, {"paramserver": text})
    path = tmp_path / "shard-0.safetensors"
    with open(path, "wb") as handle:
        handle.write(layout.header)
        for key, array in arrays.items():
            tensor_file.write_rows(handle, layout, key, 0, array)
    return path, layout


def read_back(path):
    with open(path, "rb") as handle:
        reader = tensor_file.TensorReader(handle, path.stat().st_size, str(path))
        return shard_meta.parse(reader.metadata["paramserver"], reader.tensors, str(path)), reader.tensors


@pytest.mark.parametrize("name", GOOD, ids=ascii)
def test_every_good_name_is_written_and_read_back_by_ours_and_by_safetensors(tmp_path, name):
    part = name if names.split_part(name) is None else "w"
    path, layout = shard_file(tmp_path, name, part, name)
    meta, tensors = read_back(path)
    assert list(meta["groups"]) == [name] and list(meta["tables"]) == [name]
    with safe_open(str(path), framework="numpy") as saved:  # safetensors' own (Rust) parser agrees
        assert sorted(saved.keys()) == sorted(layout.tensors)
        np.testing.assert_array_equal(saved.get_tensor(f"dense/{name}/{part}"), np.ones(2, np.float32))


@pytest.mark.parametrize("name, why", [(n, w) for n, w in BAD.items() if "surrogate" not in w], ids=ascii)
def test_the_reader_refuses_every_name_the_rule_refuses_saying_the_same(tmp_path, name, why):
    path, _ = shard_file(tmp_path, name, "w", "t")
    with pytest.raises(CheckpointError, match=f"(?s)metadata is malformed.*{why}"):
        read_back(path)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300) | st.text(st.characters(codec="utf-8"), max_size=8) | st.sampled_from(list(BAD)))
def test_the_codec_and_the_reader_accept_exactly_the_names_the_rule_does(name):
    """Hypothesis draws any text (surrogates, controls, every plane): Register decodes it as a group
    exactly when the rule says it is a name, and the checkpoint schema reads it back exactly then."""
    ok = names.name_problem(name) is None
    try:
        decode("Register", {"group": name, "optimizer": SGD}, ONE)
        decoded = True
    except MalformedFrameError:
        decoded = False
    assert decoded is ok, ascii(name)
    meta = {"shard": 0, "groups": {name: {"spec": SGD, "steps": {}}}, "tables": {}, "positions": {}}
    try:
        shard_meta.parse(json.dumps(meta), {}, "f")
        read = True
    except CheckpointError:
        read = False
    assert read is ok, ascii(name)


def test_an_embedding_whose_name_is_not_one_is_refused_where_it_is_made():
    from paramserver.nn import HashEmbedding

    with pytest.raises(InvalidArgumentError, match=r"embedding name must not hold '/'"):
        HashEmbedding(4, name="user/item")
    assert HashEmbedding(4, name="user.item é").table_name == "user.item é"
