"""A worker whose join fails because the cluster rolled back under it exits to be restarted, as after
any roll-back; one that never reached its coordinator fails as before (its address may be wrong)."""

from types import SimpleNamespace

from paramserver.worker.cluster import _rolled_back_while_joining
from paramserver.worker.recovery.rollback import RollbackFlag

NO_SHARDS = SimpleNamespace(channels=[], incarnations=[])


def coordinator(incarnation: str | None, restarted: str | None) -> SimpleNamespace:
    return SimpleNamespace(incarnation=incarnation, restarted=lambda: restarted)


def test_a_flagged_roll_back_is_the_reason():
    flag = RollbackFlag(60.0, exit_process=lambda code: None)
    flag.flag("ps 1 restarted")
    assert _rolled_back_while_joining(NO_SHARDS, flag, None) == "ps 1 restarted"


def test_a_joined_coordinator_that_restarted_or_went_away_is_the_reason():
    flag = RollbackFlag(60.0, exit_process=lambda code: None)
    went = coordinator("a1", "the coordinator does not answer (UNAVAILABLE)")
    assert _rolled_back_while_joining(NO_SHARDS, flag, went) == "the coordinator does not answer (UNAVAILABLE)"
    assert _rolled_back_while_joining(NO_SHARDS, flag, coordinator("a1", None)) is None


def test_a_coordinator_never_joined_is_no_reason():
    flag = RollbackFlag(60.0, exit_process=lambda code: None)
    never = coordinator(None, "the coordinator does not answer (UNAVAILABLE)")
    assert _rolled_back_while_joining(NO_SHARDS, flag, never) is None
    assert _rolled_back_while_joining(NO_SHARDS, flag, None) is None
