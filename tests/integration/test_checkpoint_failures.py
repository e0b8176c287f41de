"""`paramserver run` whose checkpoint writes fail for real (every process of the run limited to
1 KiB files, so each shard's write stops part-way with EFBIG; or a checkpoint directory under a
regular file, ENOTDIR, which root cannot write either): the run trains to its end, the closing
JSON line counts the failures with the OS's reason, no partial file stays, and the run exits
with NO_CHECKPOINT saying why. And `paramserver checkpoint list` of a missing directory."""

import json
import resource
import subprocess
import sys

import pytest
from tests.conftest import ROOT
from tests.unit.checkpoint_faults import files

from paramserver.launch.local.supervisor import NO_CHECKPOINT

pytestmark = pytest.mark.cluster  # training script processes

SCRIPT = ROOT / "tests" / "integration" / "scripts" / "train_resume.py"


def small_files() -> None:
    """In the launcher (and so in every node it starts): no file may grow beyond 1 KiB; a shard
    file is about 4 KiB. Python ignores SIGXFSZ, so a write past the limit fails with EFBIG."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


def under_a_file(tmp_path):
    (tmp_path / "blocker").write_text("a regular file, not a directory")
    return tmp_path / "blocker" / "ckpt"


@pytest.mark.parametrize("directory, limit, reason", [
    (lambda tmp_path: tmp_path / "ckpt", small_files, "File too large (EFBIG)"),
    (under_a_file, None, "Not a directory (ENOTDIR)"),
], ids=["file-size-limit", "not-a-directory"])
def test_a_run_whose_checkpoints_all_fail_trains_to_its_end_counts_them_and_exits_non_zero(procs, tmp_path, directory,
                                                                                          limit, reason):
    directory = directory(tmp_path)
    proc = procs.start([sys.executable, "-m", "paramserver", "run", "--ps", "2", "--workers", "1", "--progress-every",
                        "0", "--checkpoint-dir", str(directory), "--checkpoint-every", "10", str(SCRIPT), "--",
                        "--steps", "20"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       preexec_fn=limit)
    out, _ = proc.communicate(timeout=180)
    lines = out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert proc.returncode == NO_CHECKPOINT, out
    assert summary["steps"] == 20 and "dense_checksum" in summary  # trained to its end; the script's result is there
    # the checkpoints at steps 10 and 20, and the final one (step 20 again: it was never written)
    assert summary["checkpoints_written"] == 0 and summary["checkpoints_failed"] == 3, out
    assert reason in summary["checkpoint_error"]
    assert lines[-2].startswith(f"[run] the latest checkpoint to {directory} failed (3 failed, 0 written)")
    assert reason in lines[-2]
    failures = [line for line in lines if "ERROR paramserver.worker.recovery.checkpoints" in line]
    assert len(failures) == 3 and all(reason in line for line in failures)
    assert all("the next checkpoint tries again" in line for line in failures)
    if limit is not None:  # each shard's write had put part of its file on disk...
        assert ".safetensors.tmp-" in failures[0]
        assert files(tmp_path) == []  # ...and none is left, nor any shard file a failed checkpoint wrote
    assert procs.leftovers() == []


def test_checkpoint_list_of_a_missing_directory_is_an_error_naming_it(tmp_path):
    missing = tmp_path / "nowhere"
    listed = subprocess.run([sys.executable, "-m", "paramserver", "checkpoint", "list", str(missing)],
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert listed.returncode == 2 and listed.stdout == ""
    assert listed.stderr.strip() == f"paramserver: error: checkpoint directory {missing} does not exist"
