"""Fuzzing a live PS: random and near-valid frames to gRPC and to the tensor stream.

A PS process with registered variables and a table gets at least 10,000 frames on each path:
random bytes, frames with a valid prefix and random meta and tensor headers, and valid frames
with bytes flipped or cut. Hypothesis draws FRAMES / VARIANTS of them; each is sent as drawn and
in VARIANTS - 1 variants with bytes flipped, cut or inserted (drawing every frame through
hypothesis would take minutes on a loaded machine).

The PS must not crash or hang (every call and read has a deadline), never answer INTERNAL (or
UNKNOWN), answer OK only to a frame that is a well-formed request (a Hello, a pull, a new table,
...: garbage always gets an error), and its variables, their version and the table's rows must be
exactly what they were (pulled and compared before and after): a refusal changes nothing.

The generators can still draw a valid change now and then (a tensor entry written raw that fits a
variable, a byte flipped into place, a marker step: each is a push, and moves the version even when
its gradient is zero and the values stay as they were), and a valid push may rightly wait (a mode
set by an earlier valid SetMode). Such a frame is not sent (`pushes`; counted, and bounded to a
small share), so that the verdict never depends on the seed. The examples come from a random seed,
drawn per run and named in every assertion: PARAMSERVER_FUZZ_SEED=<seed> reproduces it.
"""

import json
import os
import random
import socket
import struct

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from paramserver.base.errors import ParamServerError
from paramserver.transport import stream as stream_mod
from paramserver.wire import codec
from paramserver.wire import messages as msg

pytestmark = pytest.mark.cluster
SEED = int(os.environ.get("PARAMSERVER_FUZZ_SEED") or random.SystemRandom().randrange(1 << 32))
FRAMES = 20_000
VARIANTS = 10
CALL_S = 10  # a reply later than this is a hang
PREFIX = struct.Struct("<4sBBHQ")
# Shutdown is left out: a well-formed one does what it says (the PS drains and exits;
# tests/integration/test_shutdown.py)
METHODS = [method for method in msg.SHARD_METHODS if method != "Shutdown"]
VARIABLES = {"w": (3, 2), "b": (2,)}
ROW_IDS = np.arange(10, dtype=np.int64)
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
SETTINGS = settings(max_examples=FRAMES // VARIANTS, deadline=None, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


# ---- the live PS -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live_ps():
    from tests.conftest import Procs

    procs = Procs()
    try:
        limits = {"max_message_bytes": 1 << 20, "max_table_rows": 100_000, "max_table_memory_bytes": 64 << 20}
        proc, address = procs.start_ps(PARAMSERVER_OPTIONS=json.dumps(limits))
        channel = grpc.insecure_channel(address)
        call = _caller(channel)
        optimizer = {"name": "adam", "hyper": {"lr": 0.01}}
        initial = [(name, np.arange(np.prod(shape), dtype=np.float32).reshape(shape))
                   for name, shape in VARIABLES.items()]
        _ok(call("Register", codec.encode({"group": "g", "optimizer": optimizer}, initial)))
        _ok(call("RegisterTable", codec.encode({"table": "t", "dim": 4, "optimizer": {"name": "adagrad", "hyper": {}},
                                                "init": {"kind": "normal", "std": 0.1}})))
        _ok(call("Lookup", codec.encode({"table": "t"}, [("ids", ROW_IDS)])))
        hello = codec.decode(call("Hello", codec.encode({}))[1]).meta
        yield proc, address, call, hello["stream_port"]
        channel.close()
    finally:
        procs.cleanup()


def _caller(channel):
    stubs = {m: channel.unary_unary(f"/paramserver.Shard/{m}") for m in METHODS + ["Nope"]}

    def call(method, payload):
        """(status code, reply bytes or error text)."""
        try:
            return grpc.StatusCode.OK, stubs[method](payload, timeout=CALL_S)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return call


def _ok(result):
    assert result[0] == grpc.StatusCode.OK, (result, f"PARAMSERVER_FUZZ_SEED={SEED}")
    return result[1]


def state(call):
    """Everything the fuzzing must not change: the shard's counters, its values and rows."""
    pulled = codec.decode(_ok(call("PushPull", codec.encode({"pull": list(VARIABLES)}))))
    rows = codec.decode(_ok(call("Lookup", codec.encode({"table": "t"}, [("ids", ROW_IDS)])))).tensors["rows"]
    return pulled.meta["version"], {name: value.tobytes() for name, value in pulled.tensors.items()}, rows.tobytes()


def well_formed(method, payload) -> bool:
    """Whether `payload` is a request this test itself would accept as one (then OK is no error)."""
    if method not in msg.SHARD_METHODS:
        return False
    try:
        msg.SHARD_METHODS[method][0].from_meta(codec.decode(payload).meta)
    except ParamServerError:
        return False
    return True


def pushes(method, payload) -> bool:
    """Whether `payload` is a well-formed request that validly changes what `state` compares: a
    PushPull that pushes (a dense gradient, a row push or a marker step) or an Assign. Such a draw is
    not garbage: the fuzzing does not send it."""
    if method not in ("PushPull", "Assign") or not well_formed(method, payload):
        return False
    frame = codec.decode(payload)
    if method == "Assign":
        return bool(frame.tensors)
    request = msg.PushPullRequest.from_meta(frame.meta)
    riders = {name for push in request.rows for name in (push.ids, push.grads)} | {x.ids for x in request.lookups}
    return request.marker or bool(request.rows) or any(name not in riders for name in frame.tensors)


def check_state(call, before, sent, skipped, proc) -> None:
    """The end of a fuzzing run: enough frames sent, few skipped as valid changes, the PS alive and unchanged."""
    replay = f"PARAMSERVER_FUZZ_SEED={SEED}"
    print(f"{sent} frames sent, {skipped} valid changes not sent ({replay})")
    assert sent >= FRAMES - skipped and skipped <= FRAMES // 100, (sent, skipped, replay)
    assert proc.poll() is None, ("the PS exited", proc.returncode, replay)
    after = state(call)
    assert after == before, (f"version {before[0]} -> {after[0]}", "values equal" if after[1] == before[1] else
                             "values changed", "rows equal" if after[2] == before[2] else "rows changed", replay)


# ---- frames ----------------------------------------------------------------------------------------------
FIELD_NAMES = sorted({f for request, _ in msg.SHARD_METHODS.values() for f in request.__dataclass_fields__})
json_atoms = st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | \
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12) | st.sampled_from(["t", "g", "w", "b"])
json_values = st.recursive(json_atoms, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=8) | st.sampled_from(FIELD_NAMES), inner, max_size=4),
                           max_leaves=12)
NASTY_INTS = st.sampled_from([0, 1, -1, 7, 1 << 30, (1 << 31) + 1, (1 << 63) - 1, 1 << 63, 1 << 64, -(1 << 63) - 1])
nasty_ints = NASTY_INTS | st.integers(-(1 << 70), 1 << 70)
nasty_numbers = nasty_ints | st.floats() | st.sampled_from([1e308, -0.0, 5e-324])
HYPER = ["lr", "betas", "eps", "momentum", "weight_decay", "per_row_step", "maximize", "nesterov", "lr_decay",
         "initial_accumulator_value", "dampening", "decoupled_weight_decay", "l1", "l2", "lr_power", "beta"]
specs = {  # dict-valued fields, shaped like the real ones, with nasty values
    "optimizer": st.fixed_dictionaries({"name": st.sampled_from(["sgd", "adam", "adamw", "adagrad", "ftrl", "x"])},
                                       optional={"hyper": st.dictionaries(st.sampled_from(HYPER), nasty_numbers |
                                                                          json_values, max_size=4) | json_values}),
    "consistency": st.fixed_dictionaries({}, optional={"mode": st.sampled_from(["async", "sync", "ssp", "x"]),
                                                       "workers": nasty_ints, "backups": nasty_ints,
                                                       "staleness": nasty_ints}),
    "init": st.fixed_dictionaries({"kind": st.sampled_from(["zeros", "normal", "uniform", "x"])},
                                  optional={"std": nasty_numbers, "low": nasty_numbers, "high": nasty_numbers}),
    "policy": st.dictionaries(st.sampled_from(["admit_after", "admit_probability", "ttl_steps", "min_count",
                                               "max_rows", "evict_every", "x"]),
                              nasty_numbers | json_values, max_size=3),
    "lr": st.dictionaries(st.sampled_from(["g", "x"]), nasty_numbers | json_values, max_size=2),
}
names_of_parts = st.sampled_from(["t", "g", "w", "b", "~ids", "~grads", "~rows", "x", "\ud800", "g\udfff", "a\nb"]) | \
    st.text(max_size=6)
deep = st.integers(1, 12).map(lambda n: json.loads("[" * (n * 50) + "]" * (n * 50)))


def _field_values(hint):
    """Values for a message field: of its type mostly (with nasty numbers), sometimes of any type."""
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is not None and type(None) in args:
        return st.none() | _field_values([a for a in args if a is not type(None)][0])
    typed = {int: nasty_ints, float: nasty_numbers, str: names_of_parts, bool: st.booleans()}.get(hint)
    if typed is None and origin is list:
        typed = st.lists(names_of_parts if args[0] is str else st.lists(names_of_parts, min_size=3, max_size=3)
                         if args[0] is not int else nasty_ints, max_size=3)
    return (typed if typed is not None else json_values) | json_values


def _meta_for(cls):
    from paramserver.wire.message_fields import fields_of

    return st.fixed_dictionaries({}, optional={f.name: specs.get(f.name, _field_values(f.hint)) | deep
                                               for f in fields_of(cls)})


metas = st.one_of(*[_meta_for(request) for request, _ in msg.SHARD_METHODS.values()],
                  st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8), json_values, max_size=6))
names = st.sampled_from(["w", "b", "ids", "grads", "~ids", "~grads", "~rows"]) | st.text(max_size=8)
dtypes = st.sampled_from(sorted(codec.DTYPES))
shapes = st.lists(st.integers(0, 6), max_size=3)


def _not_a_valid_change(name, dtype, shape):
    """No generated tensor may make a valid push or a row-creating lookup: garbage must change nothing."""
    if name in VARIABLES and tuple(shape) == VARIABLES[name]:  # in any dtype: a compressed gradient (codecs)
        return False
    return not (dtype == "int64" and len(shape) == 1)  # any field may name any tensor as its ids


@st.composite
def consistent_tensors(draw):
    """Tensor entries that match their data (they pass the codec and reach the service's checks)."""
    found = []
    for _ in range(draw(st.integers(0, 3))):
        name, dtype, shape = draw(names), draw(dtypes), draw(shapes)
        if not _not_a_valid_change(name, dtype, shape):
            shape = [*shape, 7]
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        array = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype=dtype).reshape(shape)
        found.append((name, array))
    return found


@st.composite
def near_valid_frames(draw):
    meta = draw(metas)
    if draw(st.booleans()):
        return codec.encode(meta, draw(consistent_tensors()))
    sizes = st.sampled_from([0, 0, 8, 16]) | NASTY_INTS | json_values
    entry = st.tuples(names, dtypes | json_values, st.lists(NASTY_INTS | st.integers(0, 4), max_size=4) | json_values,
                      sizes, sizes).map(list) | json_values
    entries = draw(st.lists(entry, max_size=3) | json_values)
    header = json.dumps(draw(st.sampled_from([{"meta": meta, "tensors": entries}, {"meta": meta}, meta,
                                              {"meta": entries, "tensors": meta}]))).encode()
    data = draw(st.binary(max_size=64))
    major = draw(st.sampled_from([codec.PROTOCOL_MAJOR] * 8 + [0, codec.PROTOCOL_MAJOR - 1, 65535]))
    length = len(header) + draw(st.sampled_from([0] * 6 + [-1, 1, 1 << 20]))
    pad = b"\0" * ((-(12 + len(header))) % 8)
    return struct.pack("<4sHHI", codec.MAGIC, major, 0, max(0, length)) + header + pad + data


@st.composite
def damaged_frames(draw):
    """A valid but refused request (wrong shape, unknown name, NaN) with bytes flipped or cut."""
    base = draw(st.sampled_from([
        codec.encode({"pull": ["w"]}, [("w", np.ones((2, 3), np.float32))]),
        codec.encode({}, [("b", np.array([np.nan, 1], np.float32))]),
        codec.encode({"table": "t"}, [("ids", ROW_IDS.astype(np.int32))]),
        codec.encode({"group": "h", "optimizer": {"name": "nope"}}, [("v", np.ones(2, np.float32))]),
        codec.encode({"rows": [["t", "ids", "grads"]]},
                     [("ids", ROW_IDS), ("grads", np.ones((10, 3), np.float32))]),
    ]))
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data[:draw(st.integers(0, len(data)))])


frames = st.binary(max_size=300) | near_valid_frames() | damaged_frames()


def variants(frame: bytes, rng: random.Random) -> list[bytes]:
    """`frame` and VARIANTS - 1 variants of it: bytes flipped, the end cut, random bytes inserted."""
    found = [frame]
    while len(found) < VARIANTS:
        data = bytearray(frame)
        how = rng.randrange(3)
        if how == 0 and data:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif how == 1:
            del data[rng.randrange(len(data) + 1):]
        else:
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.randint(1, 16))
        found.append(bytes(data))
    return found


# ---- gRPC ---------------------------------------------------------------------------------------------------
def test_random_frames_over_grpc_change_nothing(live_ps):
    proc, _, call, _ = live_ps
    before, sent, skipped = state(call), [0], [0]

    rng = random.Random(SEED)

    @SETTINGS
    @seed(SEED)
    @given(method=st.sampled_from(METHODS + ["Nope"]), frame=frames)
    def fuzz(method, frame):
        for payload in variants(frame, rng):
            if pushes(method, payload):
                skipped[0] += 1
                continue
            send_over_grpc(call, method, payload)
            sent[0] += 1

    fuzz()
    check_state(call, before, sent[0], skipped[0], proc)


def send_over_grpc(call, method, payload) -> None:
    code, reply = call(method, payload)
    replay = f"PARAMSERVER_FUZZ_SEED={SEED}"
    assert code not in BAD_CODES and code != grpc.StatusCode.DEADLINE_EXCEEDED, (method, code, reply, replay)
    assert code != grpc.StatusCode.OK or well_formed(method, payload), (method, "OK for garbage", replay)


# ---- the tensor stream ------------------------------------------------------------------------------------
class Stream:
    """A raw tensor-stream connection, reopened whenever the PS closed it."""

    def __init__(self, port):
        self.port, self.sock = port, None

    def send(self, data):
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=CALL_S)
        self.sock.sendall(data)

    def reply(self):
        """(status, message) of the next reply, or None when the PS closed the connection."""
        try:
            prefix = self._exact(PREFIX.size)
            if prefix is None:
                return None
            _, kind, status, _, size = PREFIX.unpack(prefix)
            body = self._exact(size) if kind == stream_mod.REPLY else b""
            return status, body
        except ConnectionResetError:
            self.close()
            return None

    def _exact(self, size):
        data = b""
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))  # socket.timeout here is a hang: the test fails
            if not chunk:
                self.close()
                return None
            data += chunk
        return data

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None


@st.composite
def stream_messages(draw):
    """[(bytes to send, method, frame or None)]: requests with a valid prefix (a frame and its
    variants), or one broken prefix (an attach of random JSON, shared memory never attached, an
    unknown kind, a size past the limit, no magic)."""
    kind = draw(st.sampled_from(["request"] * 6 + ["attach", "shm", "bad kind", "bad magic", "too long"]))
    method = draw(st.integers(0, len(stream_mod.METHODS) + 2))
    if kind == "request":
        return [(PREFIX.pack(stream_mod.MAGIC, stream_mod.REQUEST, 0, method, len(frame)) + frame, method, frame)
                for frame in variants(draw(frames), random.Random(draw(st.integers(0, 1 << 32))))]
    if kind == "attach":
        body = json.dumps(draw(json_values)).encode()
        message = PREFIX.pack(stream_mod.MAGIC, stream_mod.ATTACH, 0, 0, len(body)) + body
    elif kind == "shm":
        message = PREFIX.pack(stream_mod.MAGIC, stream_mod.REQUEST_SHM, 0, method, draw(st.integers(0, 1 << 20)))
    elif kind == "bad kind":
        # not a part of a request in parts (MORE | REQUEST...): the PS rightly waits for its bytes
        parts = (stream_mod.REQUEST, stream_mod.REQUEST_SHM)
        kinds = st.integers(stream_mod.AUTH + 1, 255).filter(
            lambda k: not (k & stream_mod.MORE and k & ~stream_mod.MORE in parts))
        message = PREFIX.pack(stream_mod.MAGIC, draw(kinds), 0, method, draw(st.integers(0, 64)))
    elif kind == "too long":
        size = draw(st.integers((1 << 20) + 1, (1 << 64) - 1))
        message = PREFIX.pack(stream_mod.MAGIC, stream_mod.REQUEST, 0, method, size)
    else:
        message = draw(st.binary(min_size=16, max_size=16).filter(lambda b: b[:4] != stream_mod.MAGIC))
    return [(message, None, None)] * VARIANTS  # each broken prefix on a fresh connection


def test_random_frames_over_the_tensor_stream_change_nothing(live_ps):
    proc, _, call, port = live_ps
    before, counts, stream = state(call), Counts(), Stream(port)

    @SETTINGS
    @seed(SEED)
    @given(messages=stream_messages())
    def fuzz(messages):
        fuzz_the_stream(stream, messages, counts)

    try:
        fuzz()
    finally:
        stream.close()
    check_state(call, before, counts.sent, counts.skipped, proc)


class Counts:
    def __init__(self) -> None:
        self.sent, self.skipped = 0, 0


def fuzz_the_stream(stream, messages, counts: Counts) -> None:
    """Send one draw of `stream_messages`, but for the frames that are valid changes (`pushes`)."""
    for data, method, frame in messages:
        if frame is not None and pushes(stream_method(method), frame):
            counts.skipped += 1
            continue
        send_over_the_stream(stream, data, method, frame)
        counts.sent += 1


def stream_method(method):
    return stream_mod.METHODS[method] if method is not None and method < len(stream_mod.METHODS) else None


def send_over_the_stream(stream, data, method, frame) -> None:
    stream.send(data)
    answer = stream.reply()
    replay = f"PARAMSERVER_FUZZ_SEED={SEED}"
    if answer is None:  # closed: only for a broken prefix, never for a request with a valid one
        assert frame is None, ("closed on a request", replay)
        return
    status, body = answer
    assert status not in (grpc.StatusCode.INTERNAL.value[0], grpc.StatusCode.UNKNOWN.value[0]), (body, replay)
    if status == 0:
        assert frame is not None and well_formed(stream_method(method), frame), ("OK for garbage", data[:64], replay)
    if frame is None:
        stream.close()  # the PS closes after refusing a broken prefix (an attach aside): start afresh


# ---- draws that are valid changes ------------------------------------------------------------------------
def _raw_frame(meta, entries, data=b""):
    """A frame as near_valid_frames writes one from raw tensor entries."""
    header = json.dumps({"meta": meta, "tensors": entries}).encode()
    pad = b"\0" * ((-(12 + len(header))) % 8)
    return struct.pack("<4sHHI", codec.MAGIC, codec.PROTOCOL_MAJOR, 0, len(header)) + header + pad + data


# Frames the generators draw that are valid pushes; sent, each moves the version. Found by replaying
# the stream test's generators offline on the code before this check (which draws a seed makes
# depends on the message classes too: a seed replays a failure on the code it failed on):
# - seed 196, example 1301: a marker step (a valid PushPull with nothing to push). Sent as drawn and
#   as its variant with a padding byte cut: "version 0 -> 2, values equal", the symptom CI once failed with;
# - seed 139, example 455, its fourth variant: damaged_frames' NaN gradient of "b" with random bytes
#   inserted before its data, which made it finite (version 0 -> 1, values changed).
# A row push of no rows (from raw tensor entries) moves the version with nothing changed as well.
VALID_PUSHES = {
    "a marker step": b'PSFR\x02\x00\x00\x007\x00\x00\x00{"meta":{"step":1073741824,"marker":true},"tensors":[]}'
                     b'\x00\x00\x00\x00\x00',
    "a row push of no rows": _raw_frame({"rows": [["t", "~ids", "~grads"]]}, [["~ids", "int64", [0], 0, 0],
                                                                             ["~grads", "float32", [0, 4], 0, 0]]),
    "a damaged NaN gradient made finite": b'PSFR\x02\x00\x00\x00/\x00\x00\x00{"meta":{},"tensors":[["b","float32",'
                                          b'[2],0,8]]}w\xba\xda\x80\x80p\x15"\x8d\x01\x18u\xb0\x977\x00\x00'
                                          b'\x00\x00\x00\x00\x00\xc0\x7f\x00\x00\x80',
}


@pytest.mark.parametrize("draw", list(VALID_PUSHES))
def test_a_drawn_valid_push_is_not_sent_so_the_verdict_does_not_depend_on_the_seed(live_ps, draw):
    from paramserver.server.shard import Shard
    from paramserver.server.shard_service import ShardService

    frame = VALID_PUSHES[draw]
    shard = Shard(0)  # in this process: what the draw does to a PS that takes it
    service = ShardService(shard)
    service.call("Register", codec.encode({"group": "g", "optimizer": {"name": "adam", "hyper": {"lr": 0.01}}},
                                          [(name, np.zeros(shape, np.float32)) for name, shape in VARIABLES.items()]))
    service.call("RegisterTable", codec.encode({"table": "t", "dim": 4, "optimizer": {"name": "adagrad", "hyper": {}},
                                                "init": {"kind": "normal", "std": 0.1}}))
    service.call("PushPull", frame)
    assert shard.version == 1, draw  # a valid push (a refused one would change nothing)
    assert pushes("PushPull", frame), draw

    proc, _, call, port = live_ps
    before, counts, stream = state(call), Counts(), Stream(port)
    method = stream_mod.METHODS.index("PushPull")
    try:
        fuzz_the_stream(stream, [(PREFIX.pack(stream_mod.MAGIC, stream_mod.REQUEST, 0, method, len(frame)) + frame,
                                  method, frame)], counts)
    finally:
        stream.close()
    assert (counts.sent, counts.skipped) == (0, 1), draw
    assert state(call) == before, draw
