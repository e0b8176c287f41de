"""launch/local/run_files.py and security/run_secret.py: which runs directory and run files `status`,
`health` and `shutdown` trust, and the challenge a node answers before it is sent a token."""

import json
import os
import stat

import grpc
import pytest

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError, FailedPreconditionError, UnauthenticatedError
from paramserver.coordinator.coordinator_service import SERVICE as COORDINATOR
from paramserver.coordinator.coordinator_service import CoordinatorService
from paramserver.coordinator.membership import Coordinator
from paramserver.launch.local import run_files
from paramserver.launch.local.run_files import LauncherFiles, check_runs_dir, local_run, read_run, start_time
from paramserver.launch.status import prove
from paramserver.security.auth import COORDINATOR_ACTIONS, SHARD_ACTIONS, Authorizer, Guard, TokenStore, token_hash
from paramserver.security.run_secret import RunSecret, new_nonce, new_secret
from paramserver.server.shard import Shard
from paramserver.server.shard_service import ShardService
from paramserver.transport.grpc_transport import SERVICE as SHARD
from paramserver.transport.grpc_transport import GrpcServer
from paramserver.transport.inprocess import InProcessChannel
from paramserver.wire import codec

OTHER_UID = 65534  # nobody
STORE = TokenStore.from_dict(
    {
        "format": "paramserver-tokens",
        "version": 1,
        "tokens": [{"name": "admin", "role": "admin", "worker": None, "sha256": token_hash("t-admin")}],
    }
)


@pytest.fixture
def runs(tmp_path, monkeypatch):
    folder = tmp_path / "runs"
    monkeypatch.setenv(run_files.RUN_DIR_ENV, str(folder))
    return folder


# ---- the runs directory -------------------------------------------------------------------------
def test_the_runs_directory_is_created_0700_and_accepted(runs):
    files = LauncherFiles.create()
    assert stat.S_IMODE(os.stat(runs).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(files.secret_path).st_mode) == 0o600
    check_runs_dir(runs)


@pytest.mark.parametrize("mode, who", [(0o777, "anyone"), (0o1777, "anyone"), (0o770, "its group")])
def test_a_runs_directory_others_may_write_is_refused_saying_what_to_do(runs, mode, who):
    runs.mkdir()
    runs.chmod(mode)
    for attempt in (LauncherFiles.create, local_run):
        with pytest.raises(ConfigError, match=f"may be written by {who}") as refused:
            attempt()
        assert "PARAMSERVER_RUN_DIR" in str(refused.value) and "Remove it" in str(refused.value)
    assert list(runs.iterdir()) == []  # nothing written there


def test_a_runs_directory_of_another_user_is_refused(runs):
    runs.mkdir(mode=0o700)
    with pytest.raises(ConfigError, match=rf"is owned by uid {os.getuid()}, not by you \(uid {OTHER_UID}\)"):
        check_runs_dir(runs, uid=OTHER_UID)
    if os.getuid() == 0:  # as root: the directory itself handed to another user
        os.chown(runs, OTHER_UID, -1)
        with pytest.raises(ConfigError, match=f"owned by uid {OTHER_UID}"):
            LauncherFiles.create()
        assert list(runs.iterdir()) == []


def test_a_runs_directory_that_is_a_link_or_a_file_is_refused(runs, tmp_path):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    runs.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        LauncherFiles.create()
    runs.unlink()
    runs.write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        local_run()


# ---- run files ---------------------------------------------------------------------------------
CLUSTER = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}


def test_the_launchers_own_run_file_is_trusted_with_its_secret(runs):
    files = LauncherFiles.create()
    path = files.write(CLUSTER)
    run = local_run()
    assert (run.path, run.pid, run.cluster.ps) == (path, os.getpid(), ("127.0.0.1:1",))
    nonce = new_nonce()
    assert run.secret.verify("ps-0", nonce, RunSecret.read(files.secret_path).prove("ps-0", nonce))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    files.remove()
    assert list(runs.iterdir()) == []


def _rewrite(path, **launcher):
    record = json.loads(path.read_text())
    record["launcher"].update(launcher)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "spoil, why",
    [
        (lambda path: _rewrite(path, start_time=start_time(os.getpid()) + 1), "is not running"),
        (lambda path: _rewrite(path, pid=1), "do not match its name"),
        (lambda path: path.chmod(0o644), "may be read or written by others"),
        (lambda path: path.with_suffix(".secret").unlink(), "cannot open"),
        (lambda path: path.with_suffix(".secret").write_text("guess\n"), "its secret"),
        (lambda path: path.write_text(json.dumps({"cluster": CLUSTER})), "is not a run file"),
    ],
)
def test_a_run_file_is_trusted_only_if_its_launcher_start_time_and_secret_match(runs, spoil, why):
    files = LauncherFiles.create()
    path = files.write(CLUSTER)
    spoil(path)
    with pytest.raises(ConfigError, match=why):
        read_run(path)
    with pytest.raises(ConfigError, match="no cluster given.*1 run file\\(s\\) not trusted"):
        local_run()


def test_a_run_file_of_another_user_or_through_a_link_is_not_trusted(runs, tmp_path):
    files = LauncherFiles.create()
    path = files.write(CLUSTER)
    with pytest.raises(ConfigError, match=f"not by you \\(uid {OTHER_UID}\\)"):
        read_run(path, uid=OTHER_UID)
    moved = tmp_path / "real.json"
    path.rename(moved)
    path.symlink_to(moved)
    with pytest.raises(ConfigError, match="cannot open"):
        read_run(path)


def test_a_run_file_whose_launcher_is_another_process_is_not_trusted(runs):
    """A file naming a live process of this user as its launcher, but not with that process's start time."""
    files = LauncherFiles.create()
    path = files.write(CLUSTER)
    other = runs / f"run-1-{'0' * 8}.json"
    os.rename(path, other)
    os.rename(files.secret_path, other.with_suffix(".secret"))
    _rewrite(other, pid=1, start_time=start_time(1) + 1 if start_time(1) is not None else 0)
    with pytest.raises(ConfigError, match="its launcher \\(pid 1\\) is not running"):
        read_run(other)


def test_files_of_launchers_gone_are_swept(runs):
    runs.mkdir(mode=0o700)
    dead = 2**22 + 17  # above pid_max's default: no such process
    for suffix in (".json", ".secret", ".tmp"):
        (runs / f"run-{dead}-00000000{suffix}").write_text("{}")
    files = LauncherFiles.create()
    assert sorted(p.name for p in runs.iterdir()) == [files.secret_path.name]


# ---- the challenge -----------------------------------------------------------------------------
def test_a_proof_names_its_node_and_its_secret():
    secret, nonce = RunSecret(new_secret()), new_nonce()
    proof = secret.prove("ps-0", nonce)
    assert secret.verify("ps-0", nonce, proof)
    assert not secret.verify("ps-1", nonce, proof)  # one node's answer is not another's
    assert not secret.verify("ps-0", new_nonce(), proof)
    assert not RunSecret(new_secret()).verify("ps-0", nonce, proof)
    assert "RunSecret(...)" == repr(secret)
    with pytest.raises(ConfigError):
        RunSecret("not hex")


def test_prove_needs_no_token_where_every_other_call_does():
    service = ShardService(Shard(3))
    service.guard = Guard(SHARD_ACTIONS, Authorizer(STORE, SHARD_ACTIONS))
    anonymous = InProcessChannel(service)
    nonce = new_nonce()
    with pytest.raises(FailedPreconditionError, match="holds no run secret"):
        anonymous.call("Prove", codec.encode({"nonce": nonce}), 1).wait(1)
    secret = RunSecret(new_secret())
    service.run_secret = secret
    reply = codec.decode(anonymous.call("Prove", codec.encode({"nonce": nonce}), 1).wait(1))
    assert secret.verify("ps-3", nonce, reply.meta["proof"])
    with pytest.raises(UnauthenticatedError):
        anonymous.call("Hello", codec.encode({}), 1).wait(1)
    with pytest.raises(UnauthenticatedError):  # a token given must be one the node knows, even for Prove
        InProcessChannel(service, token="t-wrong").call("Prove", codec.encode({"nonce": nonce}), 1).wait(1)


def test_status_sees_real_nodes_prove_themselves_through_the_token_gate():
    """launch/status.prove over real gRPC servers whose guards check tokens (the gate lets Prove in)."""
    secret = RunSecret(new_secret())
    shard = ShardService(Shard(0))
    shard.guard = Guard(SHARD_ACTIONS, Authorizer(STORE, SHARD_ACTIONS))
    shard.run_secret = secret
    coordinator = CoordinatorService(Coordinator(1), secret)
    coordinator.guard = Guard(COORDINATOR_ACTIONS, Authorizer(STORE, COORDINATOR_ACTIONS))
    servers = [
        GrpcServer(shard, "127.0.0.1:0", 1 << 20, 2),
        GrpcServer(coordinator, "127.0.0.1:0", 1 << 20, 2, COORDINATOR),
    ]
    try:
        ps_address, coordinator_address = (f"127.0.0.1:{server.start()}" for server in servers)
        assert prove(ps_address, SHARD, "ps-0", secret, 5, None)
        assert prove(coordinator_address, COORDINATOR, "coordinator", secret, 5, None)
        assert not prove(ps_address, SHARD, "ps-1", secret, 5, None)  # it is ps 0, not ps 1
        assert not prove(ps_address, SHARD, "ps-0", RunSecret(new_secret()), 5, None)  # another run's
        with grpc.insecure_channel(ps_address) as channel, pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(f"/{SHARD}/Hello")(codec.encode({}), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the rest still needs a token
    finally:
        for server in servers:
            server.stop(0.5)


def test_a_node_reads_its_run_secret_once_from_its_options(tmp_path):
    path = tmp_path / "s"
    path.write_text(new_secret() + "\n")
    secret = RunSecret.from_options(Options(run_secret_file=str(path)))
    path.unlink()
    nonce = new_nonce()
    assert secret is not None and secret.verify("ps-0", nonce, secret.prove("ps-0", nonce))
    assert RunSecret.from_options(Options()) is None
    with pytest.raises(ConfigError, match="cannot read the run secret file"):
        RunSecret.from_options(Options(run_secret_file=str(path)))
