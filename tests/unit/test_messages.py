"""The typed messages of wire/messages.py: round trips, refused fields, the services using them,
the bytes on the wire, and docs/protocol.md generated from them."""

import json
import typing
from pathlib import Path

import numpy as np
import pytest

from paramserver.base.errors import MalformedFrameError, NotFoundError
from paramserver.coordinator.coordinator_service import CoordinatorService
from paramserver.coordinator.membership import Coordinator
from paramserver.server.shard import Shard
from paramserver.server.shard_service import ShardService
from paramserver.transport.stream import METHODS as STREAM_METHODS
from paramserver.wire import codec
from paramserver.wire import messages as msg
from paramserver.wire.message_fields import fields_of, markdown, replaced

ROOT = Path(__file__).resolve().parents[2]
ALL = sorted(
    {cls for methods in msg.SERVICES.values() for pair in methods.values() for cls in pair},
    key=lambda cls: cls.__name__,
)
SGD = {"name": "sgd", "hyper": {"lr": 0.5}}


def example(hint):
    """A value of type `hint` that is not its field's default."""
    if hint is typing.Any:
        return {"any": [1, "x"]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if type(None) in args:
        return example(next(arg for arg in args if arg is not type(None)))
    if isinstance(hint, type) and issubclass(hint, tuple):
        return hint(
            *(example(kind) if kind is not str else f"{name}-x" for name, kind in typing.get_type_hints(hint).items())
        )
    if origin is list:
        return [example(args[0]), example(args[0])]
    if origin is dict:
        return {"k": example(args[1])}
    return {bool: True, int: 7, float: 0.25, str: "s"}[hint]


def wrong(hint):
    """A JSON value of another type than `hint` (None where every value is fine)."""
    if hint is typing.Any:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if type(None) in args:
        return wrong(next(arg for arg in args if arg is not type(None)))
    if hint is bool or hint is float:
        return "yes"
    if hint is int:
        return True  # a bool is not an integer
    if hint is str or origin is list or isinstance(hint, type) and issubclass(hint, tuple):
        return {"a": 1}
    return ["not", "an", "object"]


# fields whose check takes only values of a form (base/names.py): an example of that form
FORMED = {
    (msg.CheckpointRequest, "name"): "ckpt-000000002",
    (msg.CheckpointRequest, "parent"): "ckpt-000000001",
    (msg.PushPullRequest, "pull_as"): "bfloat16",
}


def value_of(cls, spec):
    return FORMED.get((cls, spec.name), example(spec.hint))


def full(cls):
    return cls(**{spec.name: value_of(cls, spec) for spec in fields_of(cls)})


def minimal(cls):
    return cls(**{spec.name: value_of(cls, spec) for spec in fields_of(cls) if spec.required})


# ---- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.__name__)
def test_every_message_round_trips_through_a_frame(cls):
    for message in (full(cls), minimal(cls)):
        meta = message.to_meta()
        again = codec.decode(codec.encode(meta)).meta
        assert again == meta and cls.from_meta(again) == message


@pytest.mark.parametrize("cls", ALL, ids=lambda cls: cls.__name__)
def test_optional_fields_at_their_default_are_left_out_and_unknown_keys_are_ignored(cls):
    meta = minimal(cls).to_meta()
    assert list(meta) == [spec.name for spec in fields_of(cls) if spec.required]
    assert cls.from_meta({**meta, "from_a_newer_minor_version": [1, {"x": 2}]}) == minimal(cls)


def test_json_integers_are_numbers_and_named_tuples_are_lists():
    request = msg.BarrierRequest.from_meta({"worker": 0, "name": "b", "wait": 5})
    assert request.wait == 5.0 and isinstance(request.wait, float)
    push = msg.PushPullRequest.from_meta({"rows": [["t", "r0.ids", "r0.grads"]]})
    assert push.rows == [msg.RowPush("t", "r0.ids", "r0.grads")] and push.rows[0].grads == "r0.grads"
    assert push.to_meta() == {"rows": [["t", "r0.ids", "r0.grads"]]}


# ---- refused fields ---------------------------------------------------------------------------
CASES = [
    (cls, spec.name, bad) for cls in ALL for spec in fields_of(cls) for bad in [wrong(spec.hint)] if bad is not None
]


@pytest.mark.parametrize("cls, name, bad", CASES, ids=[f"{c.__name__}.{n}" for c, n, _ in CASES])
def test_a_field_of_the_wrong_type_is_refused_naming_the_message_and_the_field(cls, name, bad):
    meta = full(cls).to_meta()
    with pytest.raises(MalformedFrameError, match=f"^{cls.TITLE}: '{name}'"):
        cls.from_meta({**meta, name: bad})


REQUIRED = [(cls, spec.name) for cls in ALL for spec in fields_of(cls) if spec.required]


@pytest.mark.parametrize("cls, name", REQUIRED, ids=[f"{c.__name__}.{n}" for c, n in REQUIRED])
def test_a_missing_required_field_is_refused_naming_it(cls, name):
    meta = full(cls).to_meta()
    del meta[name]
    with pytest.raises(MalformedFrameError, match=f"^{cls.TITLE} needs '{name}'"):
        cls.from_meta(meta)


@pytest.mark.parametrize(
    "cls, meta, fragment",
    [
        (msg.PushPullRequest, {"pull": ["w", 3]}, r"'pull'\[1\] must be a string, got 3"),
        (msg.PushPullRequest, {"lr": {"g": "fast"}}, r"'lr'\['g'\] must be a number"),
        (msg.PushPullRequest, {"rows": [["t", "a"]]}, r"'rows'\[0\] must be \[table, ids, grads\]"),
        (msg.PushPullRequest, {"lookups": [["t", "a", 5]]}, r"'lookups'\[0\]\[2\] must be a string"),
        (msg.PushPullRequest, {"marker": 1}, "'marker' must be true or false"),
        (msg.PushPullRequest, {"step": 1.5}, "'step' must be an integer or null"),
        (msg.BarrierRequest, {"worker": 0, "name": "", "wait": 1}, "'name' must not be empty"),
        (
            msg.CoordinatorReply,
            {"global_step": 0, "live": [], "workers": 1, "states": {"0": 1}, "checkpoints_requested": 0},
            r"'states'\['0'\] must be a string",
        ),
        (msg.RegisterRequest, ["group"], "meta must be an object"),
    ],
)
def test_the_error_says_where_inside_a_field(cls, meta, fragment):
    with pytest.raises(MalformedFrameError, match=fragment):
        cls.from_meta(meta)


# ---- over real requests to the services: a bad field changes nothing --------------------------
class Writer:
    def __init__(self):
        self.calls = []

    def __call__(self, name, shard, parent=""):
        self.calls.append(name)
        return {"index": shard.index, "file": f"{name}/shard-0.safetensors", "bytes": 10, "sha256": "ab"}


@pytest.fixture
def service():
    service = ShardService(Shard(0), save_checkpoint=Writer())
    service.call(
        "Register", codec.encode({"group": "g", "optimizer": SGD, "worker": 0}, [("w", np.arange(4, dtype=np.float32))])
    )
    return service


def state(service):
    hello = codec.decode(service.call("Hello", codec.encode({}))).meta
    pulled = codec.decode(service.call("PushPull", codec.encode({"pull": ["w"]})))
    return hello, pulled.tensors["w"].copy()


ROWS = {"name": "adagrad", "hyper": {"lr": 0.1}}
INIT = {"kind": "zeros"}
BAD_REQUESTS = [
    ("Register", {"group": "h", "optimizer": SGD, "worker": "0"}, [("v", np.ones(2, np.float32))], "worker"),
    (
        "Register",
        {"group": "h", "optimizer": SGD, "consistency": "sync"},
        [("v", np.ones(2, np.float32))],
        "consistency",
    ),
    ("PushPull", {"pull": ["w"], "worker": 0, "step": "3"}, [("w", np.ones(4, np.float32))], "step"),
    ("PushPull", {"lr": {"g": "0.1"}}, [("w", np.ones(4, np.float32))], "lr"),
    ("PushPull", {"marker": "yes", "worker": 0}, [], "marker"),
    ("PushPull", {"rows": [["t", "s.ids"]]}, [("w", np.ones(4, np.float32)), ("s.ids", np.ones(1, np.int64))], "rows"),
    ("SetMode", {"consistency": "sync"}, [], "consistency"),
    ("Leave", {"worker": "0"}, [], "worker"),
    ("Leave", {"barrier": "b"}, [], "worker"),
    ("RegisterTable", {"table": "t", "dim": "4", "optimizer": ROWS, "init": INIT}, [], "dim"),
    ("RegisterTable", {"table": "t", "dim": 4, "optimizer": ROWS, "init": INIT, "num_shards": 1.0}, [], "num_shards"),
    ("Lookup", {"table": ["t"]}, [("ids", np.arange(2, dtype=np.int64))], "table"),
    ("Checkpoint", {"name": 7}, [], "name"),
    ("Checkpoint", {"name": "ckpt-000000001", "collect": True, "wait_s": 600.0}, [], "wait_s"),
    ("Checkpoint", {"name": "ckpt-000000001", "background": 1}, [], "background"),
]


@pytest.mark.parametrize("method, meta, tensors, field", BAD_REQUESTS, ids=[f"{m}.{f}" for m, _, _, f in BAD_REQUESTS])
def test_a_bad_field_in_a_shard_request_is_refused_and_changes_nothing(service, method, meta, tensors, field):
    before = state(service)
    with pytest.raises(MalformedFrameError, match=f"^{method} request[: ].*'?{field}'?"):
        service.call(method, codec.encode(meta, tensors))
    after = state(service)
    assert after[0] == before[0]
    np.testing.assert_array_equal(after[1], before[1])
    assert service.save_checkpoint.calls == []
    with pytest.raises(NotFoundError):  # the group of the refused registration does not exist
        service.call("PushPull", codec.encode({"pull": ["v"]}))


def test_the_shard_services_replies_are_its_messages(service):
    hello = msg.HelloReply.from_meta(codec.decode(service.call("Hello", codec.encode({}))).meta)
    assert hello.shard == 0 and hello.protocol == [codec.PROTOCOL_MAJOR, codec.PROTOCOL_MINOR] and hello.tables == {}
    reply = codec.decode(service.call("PushPull", codec.encode({"worker": 0}, [("w", np.ones(4, np.float32))])))
    assert msg.PushPullReply.from_meta(reply.meta) == msg.PushPullReply(version=1, step=0, staleness=0, applied=True)
    entry = codec.decode(service.call("Checkpoint", codec.encode({"name": "ckpt-000000001"}))).meta
    assert msg.CheckpointReply.from_meta(entry).index == 0 and service.save_checkpoint.calls == ["ckpt-000000001"]
    left = codec.decode(service.call("Leave", codec.encode({"worker": 0}))).meta
    assert msg.LeaveReply.from_meta(left) == msg.LeaveReply(version=1, step=0)


@pytest.mark.parametrize(
    "method, meta, field",
    [
        ("Join", {"worker": True}, "worker"),
        ("Heartbeat", {"worker": 0, "step": "5"}, "step"),
        ("Heartbeat", {"worker": 0}, "step"),
        ("Barrier", {"worker": 0, "name": "", "wait": 0}, "name"),
        ("Barrier", {"worker": 0, "name": "b", "wait": "0"}, "wait"),
        ("Barrier", {"worker": 0, "name": "b", "wait": 0, "training_only": 1}, "training_only"),
        ("RequestCheckpoint", {}, "worker"),
    ],
)
def test_a_bad_field_in_a_coordinator_request_is_refused_and_changes_nothing(method, meta, field):
    coordinator = Coordinator(2)
    service = CoordinatorService(coordinator)
    before = coordinator.view()
    with pytest.raises(MalformedFrameError, match=f"^coordinator {method} request[: ].*'{field}'"):
        service.call(method, codec.encode(meta))
    assert coordinator.view() == before and coordinator.state(0) == "joining"
    service.call("Join", codec.encode({"worker": 0}))
    view = msg.CoordinatorReply.from_meta(
        codec.decode(service.call("Barrier", codec.encode({"worker": 0, "name": "b", "wait": 0}))).meta
    )
    assert view.open is False and view.waiting == [1]  # no earlier arrival was recorded


# ---- the bytes on the wire --------------------------------------------------------------------
@pytest.mark.parametrize(
    "message, old",
    [
        (
            msg.PushPullRequest(
                pull=["w:0"],
                worker=1,
                step=4,
                rows=[msg.RowPush("t", "r0.ids", "r0.grads")],
                lookups=[msg.RowLookup("t", "l2.ids", "l2.rows")],
                resumed="ckpt",
                base=9,
                lr={"g": 0.1},
            ),
            {
                "pull": ["w:0"],
                "worker": 1,
                "step": 4,
                "rows": [["t", "r0.ids", "r0.grads"]],
                "lookups": [["t", "l2.ids", "l2.rows"]],
                "resumed": "ckpt",
                "base": 9,
                "lr": {"g": 0.1},
            },
        ),
        (
            msg.PushPullRequest(pull=[], worker=0, step=0, marker=True),
            {"pull": [], "worker": 0, "step": 0, "marker": True},
        ),
        (
            msg.RegisterRequest(group="g", optimizer=SGD, consistency={"mode": "async"}, worker=2),
            {"group": "g", "optimizer": SGD, "consistency": {"mode": "async"}, "worker": 2},
        ),
        (msg.LeaveRequest(worker=1, barrier="b"), {"worker": 1, "barrier": "b"}),
        (msg.LeaveRequest(worker=1, gone="dead"), {"worker": 1, "gone": "dead"}),
        (msg.CheckpointRequest(name="n"), {"name": "n"}),
        (
            msg.RegisterTableRequest(
                table="t",
                dim=4,
                optimizer=ROWS,
                init=INIT,
                policy={"admit_after": 2},
                capacity=8,
                num_shards=2,
                consistency={"mode": "sync", "workers": 2},
            ),
            {
                "table": "t",
                "dim": 4,
                "optimizer": ROWS,
                "init": INIT,
                "policy": {"admit_after": 2},
                "capacity": 8,
                "num_shards": 2,
                "consistency": {"mode": "sync", "workers": 2},
            },
        ),
        (msg.HeartbeatRequest(worker=0, step=3), {"worker": 0, "step": 3}),
        (
            msg.BarrierRequest(worker=0, name="b", wait=5.0, training_only=True),
            {"worker": 0, "name": "b", "wait": 5.0, "training_only": True},
        ),
    ],
)
def test_requests_encode_to_the_bytes_the_dict_built_requests_had(message, old):
    assert codec.encode(message.to_meta()) == codec.encode(old)


# ---- the methods and docs/protocol.md ---------------------------------------------------------
def test_every_method_of_each_service_has_its_messages():
    assert list(ShardService(Shard(0)).methods) == list(msg.SHARD_METHODS)
    assert list(CoordinatorService(Coordinator(1)).methods) == list(msg.COORDINATOR_METHODS)
    assert set(STREAM_METHODS) <= set(msg.SHARD_METHODS)


def test_docs_protocol_md_holds_the_tables_generated_from_the_messages():
    text = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    assert replaced(text, markdown(msg.SERVICES)) == text, (
        "docs/protocol.md is out of date: run `python -m paramserver.wire.messages --write docs/protocol.md`"
    )


def test_docs_protocol_md_lists_the_streams_method_ids():
    text = " ".join((ROOT / "docs" / "protocol.md").read_text(encoding="utf-8").split())
    ids = ", ".join(f"{i} {name}" for i, name in enumerate(STREAM_METHODS))
    assert f"method id ({ids})" in text
    missing = [name for name in msg.SHARD_METHODS if name not in STREAM_METHODS]
    assert all(f"every shard method but `{name}`" in text for name in missing)


def test_the_generated_tables_name_every_field():
    section = markdown(msg.SERVICES)
    for cls in ALL:
        assert f"`{cls.__name__}`" in section
        assert all(f"| `{spec.name}` |" in section for spec in fields_of(cls))
    json.dumps(section)  # plain text
