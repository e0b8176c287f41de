"""When workers meet for a checkpoint: every N steps, when the chief's clock says so, and once at
the end of training; a store or shard that fails is logged, counted and never stops a worker,
and the next checkpoint tries again; what the launcher makes of the counts. And what
`checkpoint export` says of parameters registered without names."""

import errno
import io
import json
import logging
import re
import sys
import tempfile
import types

import numpy as np
import pytest
import torch
import torch.nn as nn
from tests.unit.checkpoint_faults import Disk, files, read_only

from paramserver import load_export
from paramserver.base.config import Options
from paramserver.base.errors import FailedPreconditionError, UnavailableError
from paramserver.checkpoint import tools
from paramserver.checkpoint.files import shard_file
from paramserver.checkpoint.store import CheckpointError, CheckpointStore, checkpoint_name
from paramserver.client.ps_client import PushRecord
from paramserver.launch.local.supervisor import NO_CHECKPOINT, LocalCluster
from paramserver.server.shard import Shard
from paramserver.tables.table_store import TableStore
from paramserver.worker.recovery.checkpoints import Checkpointer
from paramserver.worker.recovery.lineage import Lineage


class Coordinator:
    def __init__(self):
        self.view = {"checkpoints_requested": 0}

    def request_checkpoint(self):
        self.view["checkpoints_requested"] += 1
        return self.view


class Begun:
    """A checkpoint whose shard files are written: what PSClient.begin_checkpoint returns once they are."""

    begun, holds_changes = True, False

    def __init__(self, entries):
        self.entries = entries

    def collect(self):
        return self.entries


class Client:
    """Writes a one-shard checkpoint (a real shard file of an empty shard) through a store on `fs`
    (as a PS would, on the same disk); `pushes` stands for the shards' counters."""

    channels = [object()]
    incarnations = [None]  # an in-process shard: never restarts
    consistency = type("Spec", (), {"to_dict": lambda self: {"mode": "async"}})()

    def __init__(self, fs=None, directory=""):
        self.directory = directory  # the shards' own checkpoint directory
        self.saved = []
        self.pushes = 0
        self.fail = None  # an exception the shards' write raises (as it arrives over the wire)
        self.fs = fs
        self.record = PushRecord()  # what the shards said of this worker (`restored`: its position resumed at)
        self.damage = False  # a byte of each file changes after it was written (before the chief commits)

    def begin_checkpoint(self, name, timeout, parent=""):
        """As PSClient's: the files are written here; `collect()` hands their entries over."""
        return Begun(self.checkpoint(name, timeout))

    def checkpoint(self, name, timeout):
        if self.fail is not None:
            raise self.fail
        self.saved.append(name)
        store = CheckpointStore(self.directory, fs=self.fs)
        entry = shard_file.write(store, name, Shard(0), TableStore(0))
        if self.damage:
            path = store.path(name, entry.file)
            data = bytearray(open(path, "rb").read())
            data[-1] ^= 0x01
            open(path, "wb").write(bytes(data))
        return [entry.__dict__]

    def shard_stats(self):
        return [{"shard": 0, "version": self.pushes, "pushes": self.pushes, "sync_step": 0, "mode": "async",
                 "tables": {}, "staleness_mean": 0.5}]


def shard_bytes() -> int:
    """The size of the file the fake client's shard writes."""
    with tempfile.TemporaryDirectory() as directory:
        return shard_file.write(CheckpointStore(directory), "ckpt-000000001", Shard(0), TableStore(0)).bytes


def checkpointer(tmp_path, worker, coordinator=None, clock=None, every=0, every_seconds=0.0, fs=None,
                 barrier=None, report=None, keep=3):
    barriers, client, clock = [], Client(fs, str(tmp_path)), clock or [0.0]
    return Checkpointer(client, CheckpointStore(str(tmp_path), fs=fs), every, keep, worker,
                        barrier or (lambda name, timeout: barriers.append(name)), every_seconds, coordinator,
                        clock=lambda: clock[0], report=report if report is not None else lambda values: None), \
        barriers, client


def test_the_chiefs_clock_asks_and_every_worker_meets_after_its_next_step(tmp_path):
    coordinator, clock = Coordinator(), [0.0]
    chief, chief_barriers, client = checkpointer(tmp_path, 0, coordinator, clock, every_seconds=10)
    other, other_barriers, _ = checkpointer(tmp_path, 1, coordinator, clock, every_seconds=10)
    clock[0] = 5
    assert not chief.due(1) and not other.due(7)
    clock[0] = 11
    assert chief.due(2)  # the chief asks now...
    assert coordinator.view["checkpoints_requested"] == 1
    chief.on_step(2, 1.0)
    assert chief_barriers == ["checkpoint#1", "checkpoint#1:written"] and client.saved == ["ckpt-000000002"]
    assert other.due(9)  # ...and the other worker, whatever its step, meets after its next one
    other.on_step(9, 1.0)
    assert other_barriers == ["checkpoint#1", "checkpoint#1:written"]
    clock[0] = 15
    assert not chief.due(3) and not other.due(10)  # 10 s from the last checkpoint, not from the start


def test_the_chiefs_step_count_asks_and_every_worker_meets_at_the_same_barrier(tmp_path):
    coordinator = Coordinator()
    chief, barriers, client = checkpointer(tmp_path, 0, coordinator, every=5)
    other, other_barriers, _ = checkpointer(tmp_path, 1, coordinator, every=5)
    assert [step for step in range(1, 9) if other.due(step)] == []  # the other worker's count decides nothing
    assert [step for step in range(1, 5) if chief.due(step)] == []
    assert chief.due(5) and coordinator.view["checkpoints_requested"] == 1
    chief.on_step(5, 1.0)
    assert barriers == ["checkpoint#1", "checkpoint#1:written"] and client.saved == ["ckpt-000000005"]
    assert other.due(9)  # it learns of it from its next reply: the same barrier, whatever its step
    other.on_step(9, 1.0)
    assert other_barriers == ["checkpoint#1", "checkpoint#1:written"]
    assert [step for step in range(6, 16) if chief.due(step)] == [10, 15]


def test_a_step_count_and_a_clock_that_coincide_are_one_checkpoint(tmp_path):
    from paramserver.coordinator.membership import Coordinator as Membership

    membership, clock = Membership(2), [0.0]
    coordinator = type("Client", (), {"view": {}})()
    coordinator.request_checkpoint = lambda: coordinator.view.update(membership.request_checkpoint(0))
    chief, barriers, _ = checkpointer(tmp_path, 0, coordinator, clock, every=5, every_seconds=10)
    clock[0] = 11
    assert chief.due(5)  # both say so at step 5
    membership.request_checkpoint(1)  # and a request from the wire: all one checkpoint
    coordinator.view.update(membership.view())
    chief.on_step(5, 1.0)
    assert barriers == ["checkpoint#1", "checkpoint#1:written"] and membership.view()["checkpoints_requested"] == 1


def membership_client(membership, worker):
    """A worker's coordinator client on `membership` (an in-process coordinator): its view is its latest reply."""
    client = type("Client", (), {"view": {}})()
    client.request_checkpoint = lambda: client.view.update(membership.request_checkpoint(worker))
    return client


def test_workers_training_in_step_each_ask_at_the_same_step_and_meet_at_one_checkpoint(tmp_path):
    from paramserver.coordinator.membership import Coordinator as Membership

    membership = Membership(2)
    other = Checkpointer(Client(None, str(tmp_path)), CheckpointStore(str(tmp_path)), 5, 3, 1, lambda *a: None, 0.0,
                         membership_client(membership, 1), in_step=True)
    chief = Checkpointer(Client(None, str(tmp_path)), CheckpointStore(str(tmp_path)), 5, 3, 0, lambda *a: None, 0.0,
                         membership_client(membership, 0), in_step=True)
    assert [step for step in range(1, 5) if other.due(step) or chief.due(step)] == []
    assert other.due(5) and chief.due(5)  # the first to get there asks, the other's request merges into it
    assert other._barrier_after == chief._barrier_after == {5: "checkpoint#1"}
    assert membership.view()["checkpoints_requested"] == 1


def test_a_worker_waiting_at_another_barrier_meets_an_announced_checkpoint_from_there(tmp_path):
    coordinator = Coordinator()
    other, barriers, _ = checkpointer(tmp_path, 1, coordinator, every=5)
    other.due(3)
    assert not other.meet_announced(1.0) and barriers == []
    coordinator.request_checkpoint()
    assert other.meet_announced(1.0) and barriers == ["checkpoint#1", "checkpoint#1:written"]
    assert not other.meet_announced(1.0) and not other.due(4)  # met once


def test_without_a_period_nothing_is_written_while_training_but_the_final_checkpoint_is(tmp_path):
    coordinator, clock = Coordinator(), [1e6]
    chief, chief_barriers, client = checkpointer(tmp_path, 0, coordinator, clock)
    other, other_barriers, other_client = checkpointer(tmp_path, 1, coordinator, clock)
    for step in range(1, 231):
        assert not chief.due(step) and not other.due(step)
        chief.on_step(step, 1.0)
        other.on_step(step, 1.0)
    assert chief_barriers == other_barriers == [] and client.saved == []
    assert other.save_final(230, 1.0) is None  # the other worker meets the chief, and writes nothing
    assert other_barriers == ["checkpoint:final", "checkpoint:final:written"] and other_client.saved == []
    assert chief.save_final(230, 1.0) == "ckpt-000000230"
    assert chief_barriers == ["checkpoint:final", "checkpoint:final:written"] and client.saved == ["ckpt-000000230"]
    store = CheckpointStore(str(tmp_path))
    assert store.complete() == ["ckpt-000000230"] and store.manifest("ckpt-000000230")["step"] == 230


def test_the_final_checkpoint_is_not_written_twice_unless_the_shards_changed(tmp_path):
    chief, barriers, client = checkpointer(tmp_path, 0, Coordinator(), every=10)
    client.pushes = 20
    chief.on_step(20, 1.0)
    assert chief.save_final(20, 1.0) == "ckpt-000000020"  # the checkpoint at step 20 holds it already
    assert client.saved == ["ckpt-000000020"]
    assert barriers == ["checkpoint#1", "checkpoint#1:written", "checkpoint:final", "checkpoint:final:written"]
    client.pushes = 27  # another (async) worker trained on after the chief's last step
    assert chief.save_final(20, 1.0) == "ckpt-000000020"
    assert client.saved == ["ckpt-000000020", "ckpt-000000020"]  # written again, with the later state
    assert CheckpointStore(str(tmp_path)).complete() == ["ckpt-000000020"]
    assert chief.save_final(20, 1.0) == "ckpt-000000020" and len(client.saved) == 2  # and now it holds it
    client.pushes = 30
    assert chief.save_final(23, 1.0) == "ckpt-000000023"  # a later step: a new checkpoint
    assert CheckpointStore(str(tmp_path)).complete() == ["ckpt-000000020", "ckpt-000000023"]


def errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]


def test_a_full_disk_is_logged_counted_cleaned_up_and_the_next_checkpoint_tries_again(tmp_path, caplog):
    disk, reports = Disk(space=3), []  # a shard file is larger: it does not fit
    chief, barriers, client = checkpointer(tmp_path, 0, Coordinator(), every=5, fs=disk, report=reports.append)
    with caplog.at_level(logging.ERROR, logger="paramserver.worker.recovery.checkpoints"):
        chief.on_step(5, 1.0)  # no exception: training goes on
    assert barriers == ["checkpoint#1", "checkpoint#1:written"]
    [error] = errors(caplog)
    assert "checkpoint ckpt-000000005 failed" in error and "the next checkpoint tries again" in error
    assert re.search(r"cannot write \S+/ckpt-000000005/shard-0\.safetensors\.tmp-[0-9a-f]{8}: "
                     r"No space left on device \(ENOSPC\)", error)
    assert disk.partial and files(tmp_path) == []  # the partial file is gone...
    assert not (tmp_path / "ckpt-000000005").exists()  # ...and so is the failed checkpoint's directory
    assert reports[-1]["checkpoints_written"] == 0 and reports[-1]["checkpoints_failed"] == 1
    assert "No space left on device (ENOSPC)" in reports[-1]["checkpoint_error"]

    disk.space = shard_bytes() + 50  # the shard file fits, the manifest does not
    chief.on_step(10, 1.0)
    chief.settle()  # its commit, written in the background
    assert client.saved == ["ckpt-000000005", "ckpt-000000010"] and "MANIFEST.json.tmp-" in errors(caplog)[-1]
    assert files(tmp_path) == []  # the shard file it had written is deleted: a full disk gets its space back
    assert reports[-1]["checkpoints_failed"] == 2

    disk.space = None  # space freed: the next checkpoint is written
    chief.on_step(15, 1.0)
    chief.settle()  # its commit, written in the background
    assert chief.store.complete() == ["ckpt-000000015"]
    assert files(tmp_path) == ["ckpt-000000015/MANIFEST.json", "ckpt-000000015/shard-0.safetensors"]
    assert reports[-1]["checkpoints_written"] == 1 and reports[-1]["checkpoints_failed"] == 2
    assert chief.save_final(15, 1.0) == "ckpt-000000015" and chief.counts()["checkpoints_written"] == 1  # holds it


def test_a_read_only_directory_fails_every_checkpoint_and_training_goes_on(tmp_path, caplog):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    reports = []
    with read_only(directory) as fs:  # chmod, or as root a filesystem saying EROFS
        chief, barriers, client = checkpointer(directory, 0, Coordinator(), every=5, fs=fs, report=reports.append)
        with caplog.at_level(logging.ERROR, logger="paramserver.worker.recovery.checkpoints"):
            chief.on_step(5, 1.0)
            assert chief.save_final(7, 1.0) is None
    assert barriers == ["checkpoint#1", "checkpoint#1:written", "checkpoint:final", "checkpoint:final:written"]
    assert len(errors(caplog)) == 2
    assert reports[-1]["checkpoints_written"] == 0 and reports[-1]["checkpoints_failed"] == 2
    assert re.search(r"checkpoint ckpt-000000007: cannot create directory \S+/ckpt/ckpt-000000007: "
                     r"(Permission denied \(EACCES\)|Read-only file system \(EROFS\))", reports[-1]["checkpoint_error"])
    assert files(directory) == []


def test_a_shards_error_from_the_wire_is_a_counted_checkpoint_error(tmp_path, caplog):
    reports = []
    chief, barriers, client = checkpointer(tmp_path, 0, Coordinator(), report=reports.append)
    client.fail = FailedPreconditionError("127.0.0.1:5001 Checkpoint: checkpoint ckpt-000000007: cannot write "
                                          "/d/ckpt-000000007/shard-1.safetensors.tmp-0a1b2c3d: Read-only file system "
                                          "(EROFS) [FAILED_PRECONDITION]")
    with caplog.at_level(logging.ERROR, logger="paramserver.worker.recovery.checkpoints"):
        with pytest.raises(CheckpointError, match=r"checkpoint ckpt-000000007 not written: .*Read-only file system"):
            chief.save(7, 1.0)
        client.fail = UnavailableError("127.0.0.1:5001 Checkpoint: deadline exceeded")
        assert chief.save_final(7, 1.0) is None
    assert barriers == ["checkpoint:final", "checkpoint:final:written"]
    assert chief.counts() == reports[-1] == {"checkpoints_written": 0, "checkpoints_failed": 2,
                                             "checkpoint_error": "127.0.0.1:5001 Checkpoint: deadline exceeded",
                                             "checkpoint_last_failed": True}
    client.fail = None
    assert chief.save_final(7, 1.0) == "ckpt-000000007"  # tried again, and written
    assert reports[-1]["checkpoints_written"] == 1 and reports[-1]["checkpoint_last_failed"] is False


def test_old_checkpoints_that_cannot_be_deleted_leave_the_new_one_committed(tmp_path, caplog):
    disk = Disk()
    chief, _, client = checkpointer(tmp_path, 0, Coordinator(), fs=disk, keep=1)
    assert chief.save_final(3, 1.0) == "ckpt-000000003"
    disk.fail["rm"] = errno.EACCES
    client.pushes = 5
    with caplog.at_level(logging.WARNING, logger="paramserver.worker.recovery.checkpoints"):
        assert chief.save_final(6, 1.0) == "ckpt-000000006"
    assert chief.store.complete() == ["ckpt-000000003", "ckpt-000000006"]
    assert any("could not be deleted" in r.getMessage() and "Permission denied (EACCES)" in r.getMessage()
               for r in caplog.records)
    assert chief.counts() == {"checkpoints_written": 2, "checkpoints_failed": 0, "checkpoint_last_failed": False,
                              "checkpoint_latest": "ckpt-000000006"}


def test_the_chief_removes_the_temporary_files_of_an_earlier_run_before_its_first_write(tmp_path):
    for name in ("ckpt-000000003/shard-0.safetensors.tmp-0badf00d", "ckpt-000000009/MANIFEST.json.tmp-deadbeef"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"partial")
    chief, _, _ = checkpointer(tmp_path, 0, Coordinator())
    assert chief.save_final(5, 1.0) == "ckpt-000000005"
    assert files(tmp_path) == ["ckpt-000000005/MANIFEST.json", "ckpt-000000005/shard-0.safetensors"]


def launcher(tmp_path, checkpoint_dir=True):
    out = io.StringIO()
    options = Options(checkpoint_dir=str(tmp_path)) if checkpoint_dir else Options()
    return LocalCluster(1, 1, "train.py", options=options, out=out), out


def test_the_launcher_exits_non_zero_saying_why_when_a_checkpoint_of_the_run_failed(tmp_path):
    cluster, out = launcher(tmp_path)
    cluster.board.feed(json.dumps({"worker": 0, "result": {"auc": 0.9}}))  # the script's own result...
    cluster.board.feed(json.dumps({"worker": 0, "result": {  # ...and the chief's checkpoint counts
        "checkpoints_written": 0, "checkpoints_failed": 3,
        "checkpoint_error": "checkpoint ckpt-000000020: cannot write /d/x: No space left on device (ENOSPC)"}}))
    assert cluster.checkpoint_verdict(0) == NO_CHECKPOINT != 0
    said = out.getvalue()
    assert f"the latest checkpoint to {tmp_path} failed (3 failed, 0 written)" in said and "(ENOSPC)" in said
    summary = cluster.summary()
    assert summary["auc"] == 0.9 and summary["checkpoints_written"] == 0 and summary["checkpoints_failed"] == 3
    assert cluster.checkpoint_verdict(1) == 1  # a run that failed keeps its own code

    cluster.board.feed(json.dumps({"worker": 0, "result": {"checkpoints_written": 1, "checkpoints_failed": 3}}))
    assert cluster.checkpoint_verdict(0) == NO_CHECKPOINT  # one was written, then the latest failed
    cluster.board.feed(json.dumps({"worker": 0, "result": {"checkpoints_written": 2, "checkpoints_failed": 3,
                                                           "checkpoint_last_failed": True}}))
    assert cluster.checkpoint_verdict(0) == NO_CHECKPOINT  # the run's newest progress is in no checkpoint
    cluster.board.feed(json.dumps({"worker": 0, "result": {"checkpoints_written": 3, "checkpoints_failed": 3,
                                                           "checkpoint_last_failed": False}}))
    assert cluster.checkpoint_verdict(0) == 0  # a later checkpoint was written: counted, not fatal

    quiet, _ = launcher(tmp_path)
    assert quiet.checkpoint_verdict(0) == 0  # no counts: the script never trained, there was nothing to save
    elsewhere, _ = launcher(tmp_path, checkpoint_dir=False)
    elsewhere.board.feed(json.dumps({"worker": 0, "result": {"checkpoints_written": 0}}))
    assert elsewhere.checkpoint_verdict(0) == 0


def test_a_final_barrier_that_fails_writes_nothing_and_does_not_raise(tmp_path, caplog):
    met = []

    def barrier(name, timeout):
        met.append((name, timeout))
        raise UnavailableError(f"barrier {name!r}: worker 1 is gone")

    reports = []
    chief, _, client = checkpointer(tmp_path, 0, Coordinator(), barrier=barrier, report=reports.append)
    with caplog.at_level(logging.ERROR, logger="paramserver.worker.recovery.checkpoints"):
        assert chief.save_final(9, 2.0) is None
    assert met == [("checkpoint:final", None)]  # waited as long as the others are alive; then nothing more
    assert client.saved == [] and "worker 1 is gone" in caplog.records[-1].getMessage()
    assert reports[-1]["checkpoints_failed"] == 1 and "worker 1 is gone" in reports[-1]["checkpoint_error"]


# ---- export ----------------------------------------------------------------------------------

def write_checkpoint(tmp_path, variables: dict[str, np.ndarray], step=5) -> str:
    shard, tables = Shard(0), TableStore(0)
    shard.register("opt0.group0", {"name": "sgd", "hyper": {"lr": 0.1}}, variables)
    store, name = CheckpointStore(str(tmp_path / "ckpt")), checkpoint_name(step)
    entry = shard_file.write(store, name, shard, tables)
    store.commit(name, {"step": step, "num_shards": 1, "shards": [entry.__dict__]})
    return str(tmp_path / "ckpt")


def model() -> nn.Module:
    return nn.Sequential(*[nn.Linear(3, 3) for _ in range(6)])  # 12 parameters: param10 sorts after param9


def test_export_of_unnamed_parameters_says_they_are_positional_and_how_to_load_them(tmp_path, capsys):
    torch.manual_seed(0)
    trained = model()
    directory = write_checkpoint(tmp_path, {f"opt0.param{i}": p.detach().numpy().copy()
                                            for i, p in enumerate(trained.parameters())})
    out = str(tmp_path / "model.pt")
    assert tools.run_tool("export", directory, None, out) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == out  # stdout: the path alone
    note = printed.err
    assert "positional" in note and "param0" in note and "model.parameters()" in note
    assert "ps.optim.Adam(model.named_parameters(), ...)" in note
    assert "strict=False" not in note
    saved = load_export(out)
    assert list(saved["state_dict"]) == [f"param{i}" for i in range(12)]  # in the optimizer's order
    fresh = model()
    snippet = "\n".join(line[4:] for line in note.splitlines() if line.startswith("    ") and "ps.optim" not in line)
    exec(snippet, {"torch": torch, "model": fresh})  # the note's recipe, as printed
    for loaded, original in zip(fresh.parameters(), trained.parameters()):
        assert torch.equal(loaded, original)


def test_export_of_named_parameters_keeps_the_models_names_and_says_nothing(tmp_path, capsys):
    torch.manual_seed(0)
    trained = model()
    directory = write_checkpoint(tmp_path, {f"opt0.{name}": p.detach().numpy().copy()
                                            for name, p in trained.named_parameters()})
    out = str(tmp_path / "model.pt")
    tools.run_tool("export", directory, None, out)
    assert capsys.readouterr().err == ""
    fresh = model()
    fresh.load_state_dict({**fresh.state_dict(), **load_export(out)["state_dict"]})  # as docs/checkpoints.md says
    for loaded, original in zip(fresh.parameters(), trained.parameters()):
        assert torch.equal(loaded, original)


def test_export_keeps_the_optimizer_prefix_where_two_optimizers_hold_the_same_name():
    names = tools.export_names(["opt1.param0", "opt0.param1", "opt0.param0", "opt2.fc.weight", "opt0.param10",
                                "opt0.param2"])
    assert names == {"opt0.param0": "opt0.param0", "opt0.param1": "opt0.param1", "opt0.param2": "opt0.param2",
                     "opt0.param10": "opt0.param10", "opt1.param0": "opt1.param0", "opt2.fc.weight": "fc.weight"}
    note = tools.positional_note(list(names.values()), "m.pt")
    assert note.startswith("note: 5 of the 6 parameter names in m.pt are positional") and "optK.paramN" in note
    assert tools.positional_note(["fc.weight", "fc.bias"], "m.pt") is None


def test_the_chief_deletes_incomplete_checkpoints_named_after_the_one_it_committed(tmp_path):
    store = CheckpointStore(str(tmp_path))
    store.write_shard("ckpt-999999999", 0, b"stray")  # a Checkpoint call far ahead of any step, never committed
    store.write_shard("ckpt-000000001", 0, b"old")  # an older incomplete one: prune's business, not this
    chief, _, _ = checkpointer(tmp_path, 0, Coordinator(), every=5)
    chief.on_step(5, 1.0)
    chief.settle()  # its commit, written in the background
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000001", "ckpt-000000005"]
    assert store.complete() == ["ckpt-000000005"]


# ---- names after a resume, the run's id, and what counts as written ------------------------------

def resumed_checkpointer(tmp_path, restored_from=None, restored_position=0, **kwargs):
    """A chief whose shards restored `restored_from` (None: a fresh start), where its own position
    was `restored_position` (0 for a model of tables only: no shard says where it was)."""
    chief, barriers, client = checkpointer(tmp_path, 0, Coordinator(), **kwargs)
    client.record.restored = restored_position
    chief.resumed(Lineage.of(chief.store, [{"restored_from": restored_from}, {"restored_from": restored_from}]))
    return chief, barriers, client


@pytest.mark.parametrize("model, position", [("tables", 0), ("dense", 40), ("mixed", 40)])
def test_names_go_on_from_the_restored_step_and_the_run_keeps_its_id(tmp_path, model, position):
    first, _, _ = resumed_checkpointer(tmp_path, every=10)
    for step in range(1, 41):
        first.on_step(step, 1.0)
        first.settle()  # its commit, written in the background
    store = CheckpointStore(str(tmp_path))
    assert store.complete()[-1] == "ckpt-000000040"
    run_id = store.manifest("ckpt-000000040")["run_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", run_id)
    assert {store.manifest(name)["run_id"] for name in store.complete()} == {run_id}

    # resumed: the optimizer counts from the position the shards said (none for tables: 0)
    resumed, barriers, _ = resumed_checkpointer(tmp_path, "ckpt-000000040", position, every=10)
    assert resumed.lineage.resumed_step == 40 and resumed.lineage.run_id == run_id
    for step in range(position + 1, position + 6):
        resumed.on_step(step, 1.0)
        resumed.settle()  # its commit, written in the background
    assert barriers == [], model  # 41..45: no checkpoint due
    assert resumed.save_final(position + 5, 1.0) == "ckpt-000000045", model
    assert store.complete()[-1] == "ckpt-000000045" and store.manifest("ckpt-000000045")["run_id"] == run_id
    assert resumed.counts() == {"checkpoints_written": 1, "checkpoints_failed": 0, "checkpoint_last_failed": False,
                                "checkpoint_latest": "ckpt-000000045"}
    for step in range(position + 6, position + 16):
        resumed.on_step(step, 1.0)
        resumed.settle()  # its commit, written in the background
    assert store.complete()[-1] == "ckpt-000000050"  # every 10 of the run's steps, as before the resume

    fresh, _, _ = resumed_checkpointer(tmp_path / "other", every=10)
    assert fresh.lineage.resumed_from is None and fresh.lineage.run_id != run_id


def test_a_run_resumed_with_nothing_trained_keeps_its_checkpoint_as_it_is(tmp_path):
    first, _, _ = resumed_checkpointer(tmp_path)
    assert first.save_final(40, 1.0) == "ckpt-000000040"
    store = CheckpointStore(str(tmp_path))
    written = store.manifest("ckpt-000000040")
    resumed, _, client = resumed_checkpointer(tmp_path, "ckpt-000000040", 0)
    assert resumed.save_final(0, 1.0) == "ckpt-000000040"
    assert client.saved == [] and store.manifest("ckpt-000000040")["time"] == written["time"]  # not written again


def test_the_lineage_of_shards_that_restored_nothing_differently_or_an_unreadable_manifest(tmp_path, caplog):
    store = CheckpointStore(str(tmp_path))
    assert Lineage.of(store, [{}, {"restored_from": None}]).resumed_from is None
    chief, _, _ = resumed_checkpointer(tmp_path)
    chief.save(7, 1.0)
    chief.save(9, 1.0)
    with caplog.at_level(logging.WARNING, logger="paramserver.worker.recovery.lineage"):
        lineage = Lineage.of(store, [{"restored_from": "ckpt-000000007"}, {"restored_from": "ckpt-000000009"}])
    assert (lineage.resumed_from, lineage.resumed_step, lineage.run_id) == ("ckpt-000000009", 9, chief.lineage.run_id)
    assert "different checkpoints" in caplog.text
    (tmp_path / "ckpt-000000009" / "MANIFEST.json").write_text("{not json")
    lineage = Lineage.of(store, [{"restored_from": "ckpt-000000009"}])
    assert lineage.resumed_step == 9 and lineage.run_id != chief.lineage.run_id  # the name's step; a new id
    assert Lineage.of(store, [{"restored_from": "../../etc"}]).resumed_from is None  # not a checkpoint's name


def failing_checks(monkeypatch, reason: str) -> list:
    """check_checkpoint refuses every checkpoint with `reason`; returns its calls: (name, manifest,
    whether MANIFEST.json existed then)."""
    calls = []

    def check_checkpoint(store, name, manifest=None, allow_non_finite=False, contents=True):
        calls.append((name, manifest, store.fs.exists(store.path(name, "MANIFEST.json"))))
        raise CheckpointError(f"checkpoint {name}: {reason}")

    module = types.ModuleType("paramserver.checkpoint.verdict")
    module.check_checkpoint = check_checkpoint
    monkeypatch.setitem(sys.modules, "paramserver.checkpoint.verdict", module)
    return calls


def test_a_checkpoint_failing_restores_checks_is_failed_never_committed_counted_or_pruned_for(
        tmp_path, monkeypatch, caplog):
    reports = []
    chief, _, client = resumed_checkpointer(tmp_path, every=5, keep=1, report=reports.append)
    chief.on_step(5, 1.0)
    chief.settle()  # its commit, written in the background
    store = CheckpointStore(str(tmp_path))
    assert store.complete() == ["ckpt-000000005"]
    calls = failing_checks(monkeypatch, "shard-0.safetensors: metadata is malformed")
    with caplog.at_level(logging.ERROR, logger="paramserver.worker.recovery.checkpoints"):
        chief.on_step(10, 1.0)
        chief.settle()  # its commit, written in the background
        client.pushes = 3
        assert chief.save_final(12, 1.0) is None
    assert client.saved == ["ckpt-000000005", "ckpt-000000010", "ckpt-000000012"]  # written by the shards...
    assert [(name, manifest["run_id"], manifest["step"], committed) for name, manifest, committed in calls] == [
        ("ckpt-000000010", chief.lineage.run_id, 10, False), ("ckpt-000000012", chief.lineage.run_id, 12, False)]
    assert calls[1][1]["final"] is True and calls[1][1]["shards"][0]["file"] == "shard-0.safetensors"
    assert store.complete() == ["ckpt-000000005"]  # ...never committed, and the older one stays (keep 1)
    assert files(tmp_path) == ["ckpt-000000005/MANIFEST.json", "ckpt-000000005/shard-0.safetensors"]
    logged = errors(caplog)
    assert len(logged) == 2 and "checkpoint ckpt-000000010 failed" in logged[0]
    assert "fails restore's checks: checkpoint ckpt-000000010: shard-0.safetensors: metadata is malformed" in logged[0]
    assert chief.counts() == reports[-1] == {
        "checkpoints_written": 1, "checkpoints_failed": 2,
        "checkpoint_error": "not committed, it fails restore's checks: checkpoint ckpt-000000012: "
                            "shard-0.safetensors: metadata is malformed",
        "checkpoint_last_failed": True, "checkpoint_latest": "ckpt-000000005"}


def test_a_checkpoint_whose_file_changed_after_it_was_written_is_not_committed(tmp_path, caplog):
    chief, _, client = resumed_checkpointer(tmp_path, keep=1)
    assert chief.save_final(5, 1.0) == "ckpt-000000005"
    client.damage, client.pushes = True, 1
    with caplog.at_level(logging.ERROR, logger="paramserver.worker.recovery.checkpoints"):
        with pytest.raises(CheckpointError, match="not committed, it fails restore's checks: .*SHA-256"):
            chief.save(9, 1.0)
    assert CheckpointStore(str(tmp_path)).complete() == ["ckpt-000000005"]
    assert not (tmp_path / "ckpt-000000009").exists()
    assert chief.counts()["checkpoints_written"] == 1 and chief.counts()["checkpoints_failed"] == 1
