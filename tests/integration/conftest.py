"""Fixtures shared by the cluster tests here."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def thirty_steps_written(tmp_path_factory):
    """One `paramserver run` of scripts/train_resume.py: 30 steps on 2 PS with checkpoints at 10, 20
    and 30: (its closing summary, its checkpoint directory). The script is seeded and a run ends
    where any uninterrupted run of it ends, so the tests that need such a run share this one; a test
    that changes the checkpoints takes its own copy (`thirty_steps_copy`)."""
    from tests.conftest import Procs
    from tests.integration.test_checkpoints import run

    directory = tmp_path_factory.mktemp("thirty-steps") / "ckpt"
    procs = Procs()
    try:
        summary = run(procs, 2, "--checkpoint-dir", str(directory), "--checkpoint-every", "10", "--keep", "5",
                      steps=30)
        assert procs.leftovers() == []
    finally:
        procs.cleanup()
    return summary, directory


@pytest.fixture
def thirty_steps_copy(thirty_steps_written, tmp_path):
    """The shared 30-step run's summary, its checkpoints copied to tmp_path / "ckpt" for this test to change."""
    summary, directory = thirty_steps_written
    shutil.copytree(directory, tmp_path / "ckpt")
    return summary
