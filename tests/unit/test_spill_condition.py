"""A PS's spill space and stores when something goes wrong: it deletes only what it marked as its own
(no symbolic link followed, no other user's directory taken), a full disk fails only the calls that
need it, and a store that failed makes every table call UNAVAILABLE (the shard is to be recovered)."""

import os
from dataclasses import replace

import numpy as np
import pytest

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError, FailedPreconditionError, UnavailableError
from paramserver.node.ps_node import spill_tiers
from paramserver.tables.table_store import TableStore
from paramserver.tables.tiered.spill_condition import FAILED, FULL, FULL_GRACE_S, OK, SpillCondition
from paramserver.tables.tiered.spill_space import MARKER, SpillSpace, remove_stale
from paramserver.tables.tiered.spill_store import SpillError
from paramserver.tables.tiered.tiers import Tiers

BUDGET = 128 << 10
ADAGRAD = {"name": "adagrad", "hyper": {"lr": 0.1}}
INIT = {"kind": "normal", "std": 0.1}
NO_SPACE = "IO error: No space left on device: While appending to file: 000009.sst: No space left on device"


def died(space):
    """What a killed PS leaves: its marked subdirectory, its lock free."""
    space.abandon()
    return space.path


def foreign_shard_dir(root):
    """Another user's directory holding a `shard-0-*` directory with files (no marker of ours)."""
    other = root / "other"
    (other / "shard-0-theirs").mkdir(parents=True)
    (other / "shard-0-theirs" / "LOCK").touch()
    (other / "shard-0-theirs" / "data").write_bytes(b"theirs")
    return other


def test_a_spill_dir_that_is_a_symlink_is_refused_and_what_it_points_to_is_kept(tmp_path):
    other = foreign_shard_dir(tmp_path)
    (tmp_path / "spill").symlink_to(other)
    with pytest.raises(FailedPreconditionError, match="symbolic link"):
        SpillSpace.create(str(tmp_path / "spill"), 0)
    assert (other / "shard-0-theirs" / "data").read_bytes() == b"theirs"
    assert sorted(p.name for p in other.iterdir()) == ["shard-0-theirs"]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_in_a_spill_dir_of_another_user_a_ps_works_in_its_own_subdirectory_and_refuses_a_planted_one(tmp_path):
    other = foreign_shard_dir(tmp_path)
    os.chmod(other, 0o1777)  # a shared scratch directory (a Kubernetes emptyDir is root's, 0777)
    os.chown(other, 65534, 65534)
    died(SpillSpace.create(str(other), 0))  # a stale one of this user's: in its own subdirectory
    space = SpillSpace.create(str(other), 0)
    assert space.root == other / f"paramserver-{os.geteuid()}" and space.root.stat().st_uid == os.geteuid()
    assert (other / "shard-0-theirs" / "data").exists() and len(list(space.root.iterdir())) == 1
    space.close()
    planted = tmp_path / "planted"
    (planted / f"paramserver-{os.geteuid()}").mkdir(parents=True)
    os.chown(planted / f"paramserver-{os.geteuid()}", 65534, 65534)
    os.chown(planted, 65534, 65534)
    with pytest.raises(FailedPreconditionError, match="not to this user"):
        SpillSpace.create(str(planted), 0)
    (planted / "linked").mkdir()
    os.chown(planted / "linked", 65534, 65534)
    (planted / "linked" / f"paramserver-{os.geteuid()}").symlink_to(tmp_path)
    with pytest.raises(FailedPreconditionError, match="symbolic link"):
        SpillSpace.create(str(planted / "linked"), 0)


def test_only_marked_directories_of_the_user_are_stale_and_no_link_is_followed(tmp_path):
    spill = tmp_path / "spill"
    spill.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    marked_elsewhere = died(SpillSpace.create(str(elsewhere), 0))  # marked, lock free: stale where it is
    (spill / "shard-0-link").symlink_to(marked_elsewhere)  # a link to it from the spill dir
    (spill / "shard-0-nomarker").mkdir()
    (spill / "shard-0-nomarker" / "LOCK").touch()
    fake = spill / "shard-0-fakemarker"
    fake.mkdir()
    (fake / "LOCK").touch()
    (fake / MARKER).symlink_to(marked_elsewhere / MARKER)  # a marker reached through a link is none
    own = died(SpillSpace.create(str(spill), 0))
    assert remove_stale(spill, 0) == [own]
    assert marked_elsewhere.exists() and (spill / "shard-0-nomarker").exists() and fake.exists()
    assert (spill / "shard-0-link").is_symlink()


def test_a_spill_subdirectory_removed_or_replaced_is_found_and_closing_never_raises(tmp_path):
    import shutil

    tiers = Tiers.create(BUDGET, str(tmp_path / "spill"), 0)
    table = tiers.new_table("t", 8, _adagrad(), INIT, ADAGRAD, _policy())
    table.read(np.arange(5000, dtype=np.int64))  # rows on disk
    assert tiers.check() == OK
    shutil.rmtree(tiers.space.path)  # a cleanup job removed it
    assert tiers.check() == FAILED and "was removed" in tiers.condition.cause
    tiers.close()  # the stores' files are gone: closing says so in the log, never raises
    replaced = Tiers.create(BUDGET, str(tmp_path / "spill"), 0)
    os.rename(replaced.space.path, tmp_path / "moved")
    replaced.space.path.mkdir()  # another directory under its name
    assert replaced.check() == FAILED and "replaced" in replaced.condition.cause
    replaced.close()
    assert replaced.space.path.exists()  # not the one it made: left alone


def test_the_spill_full_grace_option_reaches_the_condition_of_the_tiers_a_ps_node_makes(tmp_path):
    options = Options(table_memory_budget=BUDGET, spill_dir=str(tmp_path / "spill"), spill_full_grace_s=5)
    tiers = spill_tiers(options, 0)  # what PSNode makes its TableStore's tiers with
    try:
        assert tiers is not None and tiers.condition.full_grace_s == 5.0
        assert tiers.condition.state == OK and tiers.space.path.parent == tmp_path / "spill"
    finally:
        tiers.close()
    default = spill_tiers(replace(options, spill_full_grace_s=60), 1)
    assert default.condition.full_grace_s == FULL_GRACE_S == Options().spill_full_grace_s
    default.close()
    assert spill_tiers(Options(), 0) is None  # no budget: no tiers
    for bad in (0, -1, "x"):
        with pytest.raises(ConfigError, match="^option 'spill_full_grace_s' must be"):
            replace(options, spill_full_grace_s=bad)


def test_a_condition_goes_full_then_ok_and_fails_when_full_too_long_or_the_directory_is_gone():
    now = [0.0]
    told = []
    condition = SpillCondition(full_grace_s=60.0, clock=lambda: now[0])
    condition.listen(lambda state, cause: told.append((state, cause)))
    condition.disk_full("no space")
    condition.disk_full("again")  # told once
    condition.wrote()
    assert told == [(FULL, "no space"), (OK, "the spill store writes again")] and condition.state == OK
    condition.disk_full("no space")
    now[0] = 59.0
    assert condition.check() == FULL
    now[0] = 61.0
    assert condition.check() == FAILED and "stayed full" in condition.cause
    condition.wrote()  # failed is for good
    condition.fail("other")
    assert condition.state == FAILED and [state for state, _ in told] == [FULL, OK, FULL, FAILED]
    gone = SpillCondition()
    assert gone.check("spill directory /x was removed") == FAILED and gone.cause == "spill directory /x was removed"


class FailingDb:
    """The store's RocksDB with failures injected: writes, or reads, raise what RocksDB raises."""

    def __init__(self, real, write_error=None, read_error=None):
        self.real, self.write_error, self.read_error = real, write_error, read_error

    def write(self, batch, options):
        if self.write_error:
            raise Exception(self.write_error)
        return self.real.write(batch, options)

    def get(self, keys):
        if self.read_error:
            raise Exception(self.read_error)
        return self.real.get(keys)

    def __getattr__(self, name):
        return getattr(self.real, name)


def tiered_store(tmp_path):
    tables = TableStore(0, tiers=Tiers.create(BUDGET, str(tmp_path / "spill"), 0))
    tables.register("t", 8, ADAGRAD, INIT)
    tables.lookup("t", np.arange(5000, dtype=np.int64))  # most on disk
    return tables


def test_while_the_disk_is_full_rows_in_memory_answer_and_a_call_needing_the_disk_fails(tmp_path):
    tables = tiered_store(tmp_path)
    hot = np.arange(5000, 5100, dtype=np.int64)
    before = tables.lookup("t", hot)  # in memory now
    table = tables.tiers.tables[0]
    table.store.db = FailingDb(table.store.db, write_error=NO_SPACE)
    with pytest.raises(SpillError, match="No space left on device") as raised:
        tables.lookup("t", np.arange(10_000, 12_000, dtype=np.int64))  # needs room: rows go to disk
    assert raised.value.full and tables.tiers.condition.state == FULL
    assert tables.describe()["t"]["spill_state"] == FULL
    np.testing.assert_array_equal(tables.lookup("t", hot), before)
    tables.push_checked([tables.check_push("t", hot, np.ones((100, 8), np.float32))])
    assert (tables.lookup("t", hot) < before).all()  # the push was applied
    table.store.db.write_error = None  # room again
    tables.lookup("t", np.arange(10_000, 12_000, dtype=np.int64))
    assert tables.tiers.condition.state == OK and "spill_state" not in tables.describe()["t"]
    tables.close()


def test_a_store_that_fails_makes_every_table_call_unavailable_and_closes_without_raising(tmp_path):
    tables = tiered_store(tmp_path)
    hot = np.arange(5000, 5100, dtype=np.int64)
    tables.lookup("t", hot)
    table = tables.tiers.tables[0]
    table.store.db = FailingDb(table.store.db, read_error="Corruption: block checksum mismatch in 000007.sst")
    with pytest.raises(UnavailableError, match="lost its spill store.*checksum mismatch"):
        tables.lookup("t", np.arange(100, dtype=np.int64))  # on disk
    assert tables.tiers.condition.state == FAILED
    with pytest.raises(UnavailableError):
        tables.lookup("t", hot)  # in memory, but the shard is to be recovered: nothing more is changed
    with pytest.raises(UnavailableError):
        tables.register("u", 4, ADAGRAD, INIT)
    tables.close()
    assert not (tmp_path / "spill" / tables.tiers.space.name).exists()


def _adagrad():
    from paramserver.tables.sparse_optimizers import build_sparse_optimizer

    return build_sparse_optimizer(ADAGRAD)


def _policy():
    from paramserver.tables.embedding_table import RowPolicy

    return RowPolicy()


def test_spill_files_overwritten_under_the_store_fail_it_for_good(tmp_path):
    tables = tiered_store(tmp_path)
    store = tables.tiers.tables[0].store
    store.db.flush()  # the rows on disk are in table files now
    written = list((tmp_path / "spill").glob("shard-0-*/table-1/*.sst"))
    assert written
    for path in written:  # overwritten in place (the store holds them open)
        with open(path, "r+b") as out:
            out.write(b"\xff" * path.stat().st_size)
    with pytest.raises(UnavailableError, match="lost its spill store"):
        tables.lookup("t", np.arange(1000, dtype=np.int64))  # rows on disk
    assert tables.tiers.condition.state == FAILED
    tables.close()
