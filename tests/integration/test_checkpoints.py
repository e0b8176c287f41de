"""Checkpoints with real clusters: a resumed run ends where an uninterrupted one ends, on more or
fewer PS than wrote the checkpoint; damaged checkpoints are skipped; the CLI reads them."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # several short clusters: ~40 s

RESUME = str(ROOT / "tests" / "integration" / "scripts" / "train_resume.py")


def run(procs, num_ps: int, *flags: str, steps: int = 20) -> dict:
    proc = procs.start([sys.executable, "-m", "paramserver", "run", "--ps", str(num_ps), "--workers", "1",
                        "--progress-every", "0", *flags, RESUME, "--", "--steps", str(steps)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    summary["log"] = out
    return summary


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paramserver", "checkpoint", *args], capture_output=True, text=True,
                          timeout=60)


def same_end(a: dict, b: dict) -> None:
    assert a["dense_checksum"] == pytest.approx(b["dense_checksum"], abs=1e-4)
    assert a["table_checksum"] == pytest.approx(b["table_checksum"], abs=1e-4)


@pytest.mark.parametrize("written_by, resumed_on", [(2, 3), (3, 1)])
def test_a_resumed_run_ends_where_an_uninterrupted_run_ends(procs, tmp_path, written_by, resumed_on):
    directory = str(tmp_path / "ckpt")
    whole = run(procs, written_by, "--checkpoint-dir", directory, "--checkpoint-every", "10")
    assert whole["resumed_from"] == 0
    shutil.rmtree(tmp_path / "ckpt" / "ckpt-000000020")  # as if the job had died after step 10's checkpoint
    resumed = run(procs, resumed_on, "--checkpoint-dir", directory, "--resume")
    assert resumed["resumed_from"] == 10
    assert "resuming from ckpt-000000010" in resumed["log"]
    same_end(resumed, whole)  # dense values, Adam state, step counts and table rows all came back
    fresh = run(procs, resumed_on, steps=20)
    same_end(fresh, whole)  # (and the number of PS does not change the math)
    assert procs.leftovers() == []


def test_resume_skips_a_damaged_checkpoint_and_the_cli_names_the_file(procs, tmp_path):
    directory = str(tmp_path / "ckpt")
    whole = run(procs, 2, "--checkpoint-dir", directory, "--checkpoint-every", "10", "--keep", "5", steps=30)
    latest = tmp_path / "ckpt" / "ckpt-000000030" / "shard-1.safetensors"
    data = bytearray(latest.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the newest checkpoint
    latest.write_bytes(bytes(data))
    listed = [json.loads(line)["name"] for line in cli("list", directory).stdout.splitlines()]
    assert listed == ["ckpt-000000010", "ckpt-000000020", "ckpt-000000030"]
    bad = cli("inspect", directory, "ckpt-000000030")
    assert bad.returncode == 2 and "shard-1.safetensors" in bad.stderr and "SHA-256" in bad.stderr
    resumed = run(procs, 2, "--checkpoint-dir", directory, "--resume", steps=30)
    assert resumed["resumed_from"] == 20 and "cannot resume from ckpt-000000030" in resumed["log"]
    same_end(resumed, whole)

    exported = cli("export", directory, "ckpt-000000020", "--out", str(tmp_path / "model.pt"))
    assert exported.returncode == 0, exported.stderr
    saved = torch.load(tmp_path / "model.pt")
    assert saved["step"] == 20 and set(saved["state_dict"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert saved["state_dict"]["0.weight"].shape == (16, 8)
    table = saved["embeddings"]["resume.table"]
    assert table["weight"].shape == (table["ids"].shape[0], 4) and set(table["ids"].tolist()) <= set(range(50))


def test_timed_checkpoints_keep_each_async_workers_own_position(procs, tmp_path):
    from paramserver.checkpoint.restore import RestoreSource
    from paramserver.checkpoint.store import CheckpointStore

    script = str(ROOT / "tests" / "integration" / "scripts" / "train_positions.py")
    directory = str(tmp_path / "ckpt")

    def run_positions(*flags: str) -> dict:
        proc = procs.start([sys.executable, "-m", "paramserver", "run", "--ps", "2", "--workers", "2",
                            "--progress-every", "0", "--checkpoint-dir", directory, *flags, script, "--",
                            "--steps", "80"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, out
        return json.loads(out.strip().splitlines()[-1])

    first = run_positions("--checkpoint-every-seconds", "0.4")
    assert first["worker0_resumed_at"] == 0 and first["worker1_resumed_at"] == 0
    store = CheckpointStore(directory)
    assert len(store.complete()) >= 2
    source = RestoreSource(store, store.complete()[-1])
    positions = source.positions
    assert set(positions) == {0, 1} and 0 < min(positions.values()) and max(positions.values()) <= 80
    assert positions[0] != positions[1]  # async workers at different speeds: each has its own position
    resumed = run_positions("--resume")
    assert resumed["worker0_resumed_at"] == positions[0] and resumed["worker1_resumed_at"] == positions[1]
