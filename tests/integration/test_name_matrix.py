"""What a PS accepts, its checkpoint holds: a matrix of names through a real PS process.

Raw frames (the header's bytes written by hand: raw surrogates, invalid UTF-8, escapes, control
characters, NUL, overlong names, '/') in every header field that carries a name or reaches a
checkpoint's metadata, through Register, RegisterTable and Checkpoint on gRPC, in the default
configuration (no tokens). Each is refused at the call (INVALID_ARGUMENT, saying which field and what
is wrong) and changes nothing; the names that are accepted (any script, emoji raw or as an escaped
pair, 256 characters, split parts) make a checkpoint that `checkpoint list` calls ok and a new PS
restores, value for value.
"""

import json
import struct

import grpc
import numpy as np
import pytest

from paramserver.base.errors import MalformedFrameError
from paramserver.checkpoint import tools
from paramserver.checkpoint.store import CheckpointStore
from paramserver.wire import codec

pytestmark = pytest.mark.cluster

CALL_S = 30
ADAM = {"name": "adam", "hyper": {"lr": 0.01}}
ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
INIT = {"kind": "normal", "std": 0.1}
IDS = np.arange(20, dtype=np.int64) * 7919
SLOT = "@@"  # where a case's bytes go in a frame's header

# what goes inside a JSON string of the header, as raw bytes (json.dumps never writes most of these)
BAD = {
    "raw surrogate": b"\xed\xa0\x80x",  # the finding: U+D800 as bytes, which a lenient decoder lets through
    "raw low surrogate": b"x\xed\xbf\xbf",
    "CESU-8 pair": b"\xed\xa0\xbd\xed\xb8\x80",
    "escaped surrogate": rb"\ud800x",
    "escaped low surrogate": rb"x\udc00",
    "invalid UTF-8": b"a\xff",
    "overlong UTF-8": b"\xc0\xaf",
    "raw NUL": b"a\x00b",
    "escaped NUL": rb"a\u0000b",
    "newline": rb"a\nb",
    "tab": rb"\t",
    "DEL": b"a\x7f",
    "C1": rb"a\u0085",
    "raw C1": "a\x85".encode(),
    "line separator": "a\u2028".encode(),
    "bidi override": rb"a\u202e",
    "overlong": b"x" * 257,
    "empty": b"",
    "slash": b"a/b",
}
CODEC_REFUSES = {"invalid UTF-8", "overlong UTF-8", "raw NUL"}  # not JSON text at all: the frame is refused
SURROGATES = {"raw surrogate", "raw low surrogate", "CESU-8 pair", "escaped surrogate", "escaped low surrogate"}
BAD_CHECKPOINT_NAMES = {
    "trailing newline": rb"ckpt-000000007\n",
    "other digits": "ckpt-00000000\u0667".encode(),  # ARABIC-INDIC DIGIT SEVEN: \d takes it, a file name should not
    "short": b"ckpt-7",
    "path": b"../ckpt-000000007",
}

# field -> (method, meta, tensors, what the error names): SLOT marks where the case's bytes go
FIELDS = {
    "Register group": ("Register", {"group": SLOT, "optimizer": ADAM}, [("v0", np.ones(2, np.float32))], "'group'"),
    "Register part": ("Register", {"group": "h", "optimizer": ADAM}, [(SLOT, np.ones(2, np.float32))], "part "),
    "Register optimizer": (
        "Register",
        {"group": "h", "optimizer": {"name": "adam", "hyper": {"lr": 0.01, SLOT: 1}}},
        [("v1", np.ones(2, np.float32))],
        "'optimizer'",
    ),
    "RegisterTable table": (
        "RegisterTable",
        {"table": SLOT, "dim": 4, "optimizer": ADAGRAD, "init": INIT},
        [],
        "'table'",
    ),
    "RegisterTable init": (
        "RegisterTable",
        {"table": "u", "dim": 4, "optimizer": ADAGRAD, "init": {**INIT, "note": SLOT}},
        [],
        "'init'",
    ),
    "RegisterTable policy": (
        "RegisterTable",
        {"table": "u", "dim": 4, "optimizer": ADAGRAD, "init": INIT, "policy": {SLOT: 1}},
        [],
        "'policy'",
    ),
    "Checkpoint name": ("Checkpoint", {"name": SLOT}, [], "'name'"),
    "Checkpoint parent": ("Checkpoint", {"name": "ckpt-000000005", "parent": SLOT}, [], "'parent'"),
}
SPEC_FIELDS = {"Register optimizer", "RegisterTable init", "RegisterTable policy"}  # text there may hold '/'
SURROGATE_AT = {  # where the codec says the lone surrogate is
    "Register group": "['meta']['group']",
    "Register part": "['tensors'][0][0]",
    "Register optimizer": "a key of ['meta']['optimizer']['hyper']",
    "RegisterTable table": "['meta']['table']",
    "RegisterTable init": "['meta']['init']['note']",
    "RegisterTable policy": "a key of ['meta']['policy']",
    "Checkpoint name": "['meta']['name']",
    "Checkpoint parent": "['meta']['parent']",
}


# a worker index becomes a key of a checkpoint's positions (at most 9 digits): one past them is refused too
BIG_WORKER = 10**10
WORKER_CASES = {
    "Register worker": ("Register", {"group": "g", "optimizer": ADAM, "worker": BIG_WORKER}, ["w", "b"]),
    "RegisterTable worker": (
        "RegisterTable",
        {"table": "t", "dim": 4, "optimizer": ADAGRAD, "init": INIT, "worker": BIG_WORKER},
        [],
    ),
    "PushPull worker": ("PushPull", {"worker": BIG_WORKER}, ["w", "b"]),
    "Assign worker": ("Assign", {"worker": BIG_WORKER}, ["w", "b"]),
}
SHAPES = {"w": (3, 2), "b": (2,)}  # of the group "g" every matrix case meets


def raw_frame(meta, tensors=(), fill=None):
    """codec.encode(meta, tensors), with the header's SLOT replaced by the bytes `fill`."""
    payload = codec.encode(meta, list(tensors))
    magic, major, minor, length = struct.unpack_from("<4sHHI", payload)
    end = 12 + length
    header = payload[12:end] if fill is None else payload[12:end].replace(SLOT.encode(), fill)
    data = payload[end + (-end % 8) :]
    return struct.pack("<4sHHI", magic, major, minor, len(header)) + header + b"\0" * (-(12 + len(header)) % 8) + data


def cases():
    """(field, case label, method, payload, what the error must say)."""
    for field, (method, meta, tensors, named) in FIELDS.items():
        bad = dict(BAD)
        if field.startswith("Checkpoint"):
            bad.update(BAD_CHECKPOINT_NAMES)
            if field == "Checkpoint parent":
                del bad["empty"]  # no parent: a whole checkpoint
        for label, fill in bad.items():
            if field in SPEC_FIELDS and label == "slash":
                continue
            if label in CODEC_REFUSES:
                says = ["frame header is not"]
            elif label in SURROGATES:
                says = ["lone surrogate", SURROGATE_AT[field]]
            else:
                says = [f"{method} request: ", named]
            yield field, label, method, raw_frame(meta, tensors, fill), says
    for field, (method, meta, parts) in WORKER_CASES.items():
        tensors = [(part, np.full(SHAPES[part], 5.0, np.float32)) for part in parts]
        yield field, "10 digits", method, raw_frame(meta, tensors), [f"{method} request: 'worker' must be at most"]


class Ps:
    """A PS process and raw gRPC calls to it: call(method, payload) -> (status code, reply bytes or details)."""

    def __init__(self, procs, directory, resume=False):
        options = {"checkpoint_dir": str(directory), "resume": resume}
        self.proc, self.address = procs.start_ps(PARAMSERVER_OPTIONS=json.dumps(options))
        self.channel = grpc.insecure_channel(self.address)
        self.directory = directory

    def call(self, method, payload):
        try:
            return grpc.StatusCode.OK, self.channel.unary_unary(f"/paramserver.Shard/{method}")(payload, timeout=CALL_S)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()

    def ok(self, method, meta, tensors=()):
        code, reply = self.call(method, codec.encode(meta, list(tensors)))
        assert code == grpc.StatusCode.OK, (method, meta, reply)
        return codec.decode(reply)

    def state(self, parts, tables):
        """Everything a refusal must leave alone: counters, groups, tables, values, rows, files."""
        hello = self.ok("Hello", {}).meta
        pulled = self.ok("PushPull", {"pull": parts})
        rows = {
            table: self.ok("Lookup", {"table": table}, [("ids", IDS)]).tensors["rows"].tobytes() for table in tables
        }
        files = sorted(str(p.relative_to(self.directory)) for p in self.directory.rglob("*"))
        values = {name: value.tobytes() for name, value in pulled.tensors.items()}
        return json.dumps(hello, sort_keys=True), values, rows, files

    def close(self):
        self.channel.close()


def settled(ps, before):
    """None where the PS is as it was `before`, else what differs."""
    try:
        now = ps.state(["w", "b"], ["t"])
    except (AssertionError, MalformedFrameError) as exc:  # e.g. a Hello naming a table no frame may carry
        return f"the PS no longer answers what it did: {str(exc)[:200]}"
    return None if now == before else "the refusal changed the PS"


def commit(directory, name, entry):
    CheckpointStore(str(directory)).commit(name, {"step": int(name[5:]), "num_shards": 1, "shards": [entry]})


def listed(directory):
    return {row["name"]: row["status"] for row in tools.list_checkpoints(str(directory))}


# ---- the finding, exactly ------------------------------------------------------------------------------
def test_a_register_whose_group_holds_a_raw_surrogate_is_refused_and_the_next_checkpoint_restores(procs, tmp_path):
    directory = tmp_path / "ckpt"
    ps = Ps(procs, directory)
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    ps.ok("Register", {"group": "g", "optimizer": ADAM}, [("w", w)])
    before = ps.state(["w"], [])
    rogue = raw_frame({"group": SLOT, "optimizer": ADAM}, [("x", np.ones(2, np.float32))], b"\xed\xa0\x80x")
    assert b'"group":"\xed\xa0\x80x"' in rogue  # the bytes of the finding, not the \ud800 escape
    code, details = ps.call("Register", rogue)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "lone surrogate" in details and "['meta']['group']" in details, details
    assert ps.state(["w"], []) == before

    entry = ps.ok("Checkpoint", {"name": "ckpt-000000001"}).meta
    commit(directory, "ckpt-000000001", entry)
    assert listed(directory) == {"ckpt-000000001": "ok"}
    ps.close()
    again = Ps(procs, directory, resume=True)
    assert again.ok("Hello", {}).meta["restored_from"] == "ckpt-000000001"
    restored = again.ok("Register", {"group": "g", "optimizer": ADAM}, [("w", np.zeros((3, 2), np.float32))])
    np.testing.assert_array_equal(restored.tensors["w"], w)
    again.close()


# ---- the matrix --------------------------------------------------------------------------------------------
ACCEPTED_GROUPS = {  # group (the bytes in the header) -> {part: values}; each must restore as it was
    "é表😀 grp".encode(): {
        "fc.weight[0:3]": np.arange(6, dtype=np.float32).reshape(3, 2),
        "bias é": np.ones(2, np.float32),
    },
    rb"\ud83d\ude00" + b"x" * 255: {"y" * 256: np.full(3, 2.0, np.float32)},  # 256 characters, one an escaped pair
}
ACCEPTED_TABLES = {"tbl ü😀".encode(): "tbl ü😀", b"z" * 256: "z" * 256}


def test_every_name_in_every_field_is_refused_at_the_call_or_its_checkpoint_restores(procs, tmp_path):
    directory = tmp_path / "ckpt"
    ps = Ps(procs, directory)
    w = np.arange(6, dtype=np.float32).reshape(3, 2)
    ps.ok("Register", {"group": "g", "optimizer": ADAM}, [("w", w), ("b", np.ones(2, np.float32))])
    ps.ok("RegisterTable", {"table": "t", "dim": 4, "optimizer": ADAGRAD, "init": INIT})
    ps.ok("Lookup", {"table": "t"}, [("ids", IDS)])  # the rows exist before: a state's lookup creates none
    before = ps.state(["w", "b"], ["t"])

    wrong, count = [], 0
    for field, label, method, payload, says in cases():
        code, details = ps.call(method, payload)
        count += 1
        problem = None
        if code != grpc.StatusCode.INVALID_ARGUMENT:
            problem = f"answered {code.name}: {str(details)[:200]!r}"
        elif not all(fragment in details for fragment in says):
            problem = f"error does not say {says}: {details!r}"
        if problem is None:
            problem = settled(ps, before)
        if problem:
            wrong.append(f"{field} / {label}: {problem}")
    assert not wrong, f"{len(wrong)} of {count} cases:\n" + "\n".join(wrong)
    assert count > 140

    # what is accepted: any script, emoji raw or escaped, 256 characters, split parts
    saved_groups = {}
    for group, parts in ACCEPTED_GROUPS.items():
        payload = raw_frame({"group": SLOT, "optimizer": ADAM}, list(parts.items()), group)
        code, reply = ps.call("Register", payload)
        assert code == grpc.StatusCode.OK, (group, reply)
        saved_groups[codec.decode(payload).meta["group"]] = parts
    saved_rows = {}
    for table_bytes, table in ACCEPTED_TABLES.items():
        payload = raw_frame({"table": SLOT, "dim": 4, "optimizer": ADAGRAD, "init": INIT}, (), table_bytes)
        code, reply = ps.call("RegisterTable", payload)
        assert code == grpc.StatusCode.OK, (table, reply)
        saved_rows[table] = ps.ok("Lookup", {"table": table}, [("ids", IDS)]).tensors["rows"].copy()
    saved_rows["t"] = ps.ok("Lookup", {"table": "t"}, [("ids", IDS)]).tensors["rows"].copy()

    entry = ps.ok("Checkpoint", {"name": "ckpt-000000002"}).meta
    commit(directory, "ckpt-000000002", entry)
    assert listed(directory) == {"ckpt-000000002": "ok"}
    ps.close()

    again = Ps(procs, directory, resume=True)
    assert again.ok("Hello", {}).meta["restored_from"] == "ckpt-000000002"
    for group, parts in {"g": {"w": w, "b": np.ones(2, np.float32)}, **saved_groups}.items():
        zeros = [(part, np.zeros_like(value)) for part, value in parts.items()]
        restored = again.ok("Register", {"group": group, "optimizer": ADAM}, zeros)
        for part, value in parts.items():
            np.testing.assert_array_equal(restored.tensors[part], value, err_msg=f"{group!a} {part!a}")
    for table, rows in saved_rows.items():
        again.ok("RegisterTable", {"table": table, "dim": 4, "optimizer": ADAGRAD, "init": INIT})
        got = again.ok("Lookup", {"table": table}, [("ids", IDS)]).tensors["rows"]
        np.testing.assert_array_equal(got, rows, err_msg=ascii(table))
    again.close()
