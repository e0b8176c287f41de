"""Checkpoint names and data positions after a resume, with real clusters: names go on from the
restored checkpoint's step whatever the model holds (tables only, dense only, both) and whatever step
count the resumed script reaches, every manifest names the run, the same id across the resume (a
fresh run's new id: unit tests), and the worker's data goes on at the position the shards restored."""

import pytest
from tests.conftest import ROOT
from tests.integration.test_checkpoints import run

from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.cluster  # two short clusters per model: ~15 s each

MODELS = str(ROOT / "tests" / "integration" / "scripts" / "train_models.py")


@pytest.mark.parametrize("model", ["tables", "dense", "mixed"])
def test_a_resumed_run_names_its_checkpoints_after_the_restored_step(procs, tmp_path, model):
    directory = str(tmp_path / "ckpt")
    flags = ("--checkpoint-dir", directory, "--checkpoint-every", "10")
    first = run(procs, 2, *flags, steps=40, script=MODELS, args=("--model", model))
    store = CheckpointStore(directory)
    assert first["checkpoints_written"] == 4 and store.complete()[-1] == "ckpt-000000040", first["log"]
    assert (first["resume_step"], first["first_batch"], first["started_at"]) == (0, 0, 0), first["log"]
    run_id = store.manifest("ckpt-000000040")["run_id"]

    # the script trains 5 steps of its own: the run's step goes on from 40
    resumed = run(procs, 2, *flags, "--resume", steps=5, script=MODELS, args=("--model", model))
    assert "resuming from ckpt-000000040" in resumed["log"]
    assert (resumed["checkpoints_written"], resumed["checkpoints_failed"]) == (1, 0), resumed["log"]
    assert store.complete()[-1] == "ckpt-000000045", resumed["log"]
    # its data goes on at batch 40 (the position the shards restored), as its optimizer's steps do
    assert resumed["resume_step"] == 40 and resumed["first_batch"] == 40, resumed["log"]
    assert (resumed["started_at"], resumed["ended_at"]) == (40, 45), resumed["log"]
    assert store.manifest("ckpt-000000045")["run_id"] == run_id
    assert RestoreSource(store, "ckpt-000000045").step == 45  # it restores
    assert procs.leftovers() == []
