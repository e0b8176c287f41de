"""security/auth.py: the token store, roles, acting as a worker; security/tokens.py; the in-process twin's tokens."""

import json
import re
import stat

import numpy as np
import pytest

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError, NotFoundError, PermissionDeniedError, UnauthenticatedError
from paramserver.security.auth import (
    COORDINATOR_ACTIONS,
    SHARD_ACTIONS,
    Authorizer,
    Guard,
    Principal,
    TokenStore,
    read_token,
    token_hash,
)
from paramserver.security.tokens import local_nodes, with_node_token, write_tokens
from paramserver.server.shard import Shard
from paramserver.server.shard_service import ShardService
from paramserver.transport.inprocess import InProcessChannel
from paramserver.wire import codec


def store_of(*entries):
    return TokenStore.from_dict({"format": "paramserver-tokens", "version": 1, "tokens": [
        {"name": name, "role": role, "worker": worker, "sha256": token_hash(token)}
        for name, role, worker, token in entries]})


STORE = store_of(("ps-0", "ps", None, "t-ps"), ("worker-0", "chief", 0, "t-chief"),
                 ("worker-1", "worker", 1, "t-w1"), ("admin", "admin", None, "t-admin"))


@pytest.mark.parametrize("method, token, worker, allowed", [
    ("PushPull", "t-w1", 1, True), ("PushPull", "t-w1", None, True), ("PushPull", "t-w1", 0, False),
    ("Register", "t-w1", 2, False), ("Leave", "t-w1", 0, False), ("Leave", "t-w1", 1, True),
    ("Hello", "t-ps", None, True), ("PushPull", "t-ps", None, False),
    ("SetMode", "t-w1", None, False), ("Checkpoint", "t-w1", None, False), ("Forget", "t-w1", 1, False),
    ("SetMode", "t-chief", None, True), ("Checkpoint", "t-chief", None, True), ("Forget", "t-chief", 1, True),
    ("PushPull", "t-chief", 1, False),  # the chief trains as worker 0 only
    ("Restart", "t-chief", None, True), ("Restart", "t-w1", None, False),  # the chief's roll-back
    ("End", "t-chief", None, True), ("End", "t-w1", None, False),  # the chief ends the PS once the run completed
    ("Shutdown", "t-chief", None, False), ("Shutdown", "t-admin", None, True),
    ("Assign", "t-chief", 0, True), ("Assign", "t-w1", 1, False),  # dense values before a checkpoint
    ("PushPull", "t-admin", 3, True), ("Explode", "t-admin", None, False)])
def test_shard_roles(method, token, worker, allowed):
    authorizer = Authorizer(STORE, SHARD_ACTIONS)
    if allowed:
        assert isinstance(authorizer.authorize(method, token, worker), Principal)
    else:
        with pytest.raises(PermissionDeniedError):
            authorizer.authorize(method, token, worker)


@pytest.mark.parametrize("method, token, worker, allowed", [
    ("Join", "t-w1", 1, True), ("Join", "t-w1", 0, False), ("Heartbeat", "t-w1", 0, False),
    ("Finish", "t-w1", 1, True), ("Barrier", "t-w1", 1, True), ("RequestCheckpoint", "t-w1", 1, False),
    ("RequestCheckpoint", "t-chief", 0, True), ("Join", "t-ps", 0, False), ("Hello", "t-ps", None, True)])
def test_coordinator_roles(method, token, worker, allowed):
    authorizer = Authorizer(STORE, COORDINATOR_ACTIONS)
    if allowed:
        assert authorizer.authorize(method, token, worker).name
    else:
        with pytest.raises(PermissionDeniedError):
            authorizer.authorize(method, token, worker)


@pytest.mark.parametrize("token", [None, "", "t-w2", "T-W1", "t-w1 "])
def test_missing_or_unknown_tokens_are_unauthenticated(token):
    with pytest.raises(UnauthenticatedError):
        Authorizer(STORE, SHARD_ACTIONS).authorize("Hello", token)


BAD_STORES = [
    ("not json", "{", "cannot read"),
    ("wrong format", json.dumps({"format": "x", "version": 1, "tokens": []}), "not a token store"),
    ("no tokens", json.dumps({"format": "paramserver-tokens", "version": 1, "tokens": []}), "non-empty"),
    ("bad role", [{"name": "a", "role": "root", "worker": None, "sha256": "0" * 64}], "tokens[0].role"),
    ("worker without index", [{"name": "a", "role": "worker", "sha256": "0" * 64}], "tokens[0].worker is needed"),
    ("bad index", [{"name": "a", "role": "worker", "worker": -1, "sha256": "0" * 64}], "tokens[0].worker must"),
    ("plain token", [{"name": "a", "role": "admin", "sha256": "secret"}], "tokens[0].sha256"),
    ("same name", [{"name": "a", "role": "admin", "sha256": "0" * 64},
                   {"name": "a", "role": "admin", "sha256": "1" * 64}], "name given more than once"),
    ("same hash", [{"name": "a", "role": "admin", "sha256": "0" * 64},
                   {"name": "b", "role": "admin", "sha256": "0" * 64}], "sha256 given more than once"),
]


@pytest.mark.parametrize("case, content, fragment", BAD_STORES, ids=[c[0] for c in BAD_STORES])
def test_bad_token_stores_are_config_errors(tmp_path, case, content, fragment):
    if isinstance(content, list):
        content = json.dumps({"format": "paramserver-tokens", "version": 1, "tokens": content})
    path = tmp_path / "tokens.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        TokenStore.load(path)


def test_missing_store_and_token_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read token store"):
        TokenStore.load(tmp_path / "absent.json")
    with pytest.raises(ConfigError, match="cannot read token file"):
        read_token(tmp_path / "absent.token")
    (tmp_path / "spaced.token").write_text("two words\n")
    with pytest.raises(ConfigError, match="printable ASCII"):
        read_token(tmp_path / "spaced.token")


def test_write_tokens_gives_each_node_its_role_and_worker(tmp_path):
    write_tokens(tmp_path, ["ps-0", "chief-0", "worker-0", "worker-1", "admin"])
    data = json.loads((tmp_path / "tokens.json").read_text())
    assert [(e["name"], e["role"], e["worker"]) for e in data["tokens"]] == [
        ("ps-0", "ps", None), ("chief-0", "chief", 0), ("worker-0", "worker", 1), ("worker-1", "worker", 2),
        ("admin", "admin", None)]
    store = TokenStore.load(tmp_path / "tokens.json")
    for entry in data["tokens"]:
        path = tmp_path / f"{entry['name']}.token"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        token = read_token(path)
        assert token not in (tmp_path / "tokens.json").read_text()  # only its hash is stored
        assert store.find(token).name == entry["name"]
    assert stat.S_IMODE((tmp_path / "tokens.json").stat().st_mode) == 0o600


def test_without_a_chief_worker_0_is_the_chief(tmp_path):
    write_tokens(tmp_path, local_nodes(1, 2))
    roles = {e["name"]: (e["role"], e["worker"]) for e in json.loads((tmp_path / "tokens.json").read_text())["tokens"]}
    assert roles == {"ps-0": ("ps", None), "worker-0": ("chief", 0), "worker-1": ("worker", 1),
                     "admin": ("admin", None)}
    options = with_node_token(Options(), tmp_path, "worker-1")
    assert read_token(options.token_file) and TokenStore.load(options.auth_tokens)
    assert with_node_token(Options(), None, "worker-1") == Options()


@pytest.mark.parametrize("nodes", [[], ["ps-0", "gpu-1"], ["worker-0", "worker-0"], ["chief-1"], ["ps-x"]])
def test_bad_node_names_write_nothing(tmp_path, nodes):
    with pytest.raises(ConfigError):
        write_tokens(tmp_path / "out", nodes)
    assert not (tmp_path / "out").exists()


def test_the_in_process_twin_checks_tokens_when_its_service_has_a_guard():
    service = ShardService(Shard(0))
    service.guard = Guard(SHARD_ACTIONS, Authorizer(STORE, SHARD_ACTIONS))
    register = codec.encode({"group": "g", "optimizer": {"name": "sgd", "hyper": {"lr": 1}}, "worker": 1},
                            [("b", np.zeros(2, np.float32))])
    with pytest.raises(UnauthenticatedError):
        InProcessChannel(service).call("Register", register, 1).wait(1)
    with pytest.raises(PermissionDeniedError):
        InProcessChannel(service, token="t-ps").call("Register", register, 1).wait(1)
    good = InProcessChannel(service, token="t-w1")
    pull = codec.encode({"pull": ["b"], "worker": 1})
    with pytest.raises(NotFoundError):  # the refused Register created nothing
        good.call("PushPull", pull, 1).wait(1)
    good.call("Register", register, 1).wait(1)
    assert codec.decode(good.call("PushPull", pull, 1).wait(1)).tensors["b"].tolist() == [0, 0]


@pytest.mark.parametrize("method, token, allowed", [
    ("Leave", "t-w1", True), ("Shutdown", "t-chief", True),  # a Forget / a Restart: the request says which
    ("Shutdown", "t-w1", False), ("Checkpoint", "t-w1", False), ("PushPull", "t-ps", False),
    ("Hello", "t-ps", True), ("Explode", "t-ps", True)])  # a method not in the table: the transport's to refuse
def test_the_method_is_checked_before_the_request_is_read(method, token, allowed):
    """Guard.permit_method: what the gRPC gate checks from a call's metadata alone (the least role of
    any form of the method)."""
    guard = Guard(SHARD_ACTIONS, Authorizer(STORE, SHARD_ACTIONS))
    principal = guard.authenticate(token)
    if allowed:
        guard.permit_method(principal, method)
    else:
        with pytest.raises(PermissionDeniedError):
            guard.permit_method(principal, method)


@pytest.mark.parametrize("peer, checks, told", [
    ("ipv4:10.0.0.9:5000", False, False), ("('10.0.0.9', 5000)", False, False),
    ("ipv4:127.0.0.1:5000", False, True), ("ipv6:[::1]:5000", False, True), ("('127.0.0.1', 5000)", False, True),
    ("ipv4:10.0.0.9:5000", True, True)])  # with a token the store knows
def test_a_hello_without_a_token_from_another_host_says_nothing_of_the_process(peer, checks, told):
    import socket

    from paramserver.transport.dispatch import answer
    from paramserver.transport.stream import host_id

    service = ShardService(Shard(0))
    service.guard = Guard(SHARD_ACTIONS, Authorizer(STORE, SHARD_ACTIONS) if checks else None)
    service.announce.update(host_id=host_id(), stream_port=1234)
    result = answer(service, "Hello", codec.encode({"process": True}), peer, token="t-ps" if checks else None)
    meta = codec.decode(result.reply).meta
    assert (meta.get("rss_bytes") is not None) == told
    assert meta["stream_port"] == 1234 and re.fullmatch(r"[0-9a-f]{32}", meta["host_id"])
    assert socket.gethostname() not in meta["host_id"]


@pytest.mark.parametrize("fields, token, allowed", [
    ({"end": True}, "t-chief", True), ({"end": True}, "t-w1", False), ({}, "t-chief", False), ({}, "t-admin", True)])
def test_a_shutdown_ending_the_run_is_the_chiefs_and_any_other_an_admins(fields, token, allowed):
    """The request says which action a Shutdown is: with `end` (stop_ps_at_end) the chief may call it."""
    service = ShardService(Shard(0))
    service.guard = Guard(SHARD_ACTIONS, Authorizer(STORE, SHARD_ACTIONS))
    asked = []
    service.on_shutdown = asked.append
    call = InProcessChannel(service, token=token).call("Shutdown", codec.encode({"reason": "r", **fields}), 1)
    if allowed:
        call.wait(1)
        assert asked == [False]  # not a restart: the PS exits 0
    else:
        with pytest.raises(PermissionDeniedError):
            call.wait(1)
        assert asked == []
