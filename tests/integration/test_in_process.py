"""`paramserver.init()` with no cluster: the same script runs in one process (debugger friendly)."""

import json
import subprocess
import sys

import pytest
from tests.conftest import ROOT

import paramserver as ps


@pytest.mark.cluster
def test_digits_example_runs_as_a_plain_python_script(procs):
    proc = procs.start([sys.executable, str(ROOT / "examples" / "digits.py"), "--epochs", "3"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "epoch 3/3" in out and "test accuracy" in out


@pytest.mark.cluster
def test_ctr_example_learns_the_hidden_model(procs, tmp_path):
    data = ROOT / "examples" / "ctr_data.py"
    for name, rows, seed in (("train", 30000, 1), ("test", 5000, 2)):
        subprocess.run([sys.executable, str(data), "--rows", str(rows), "--seed", str(seed), "--vocab", "20000",
                        "--out", str(tmp_path / f"{name}.tsv")], check=True, timeout=120)
    proc = procs.start([sys.executable, "-m", "paramserver", "run", "--ps", "2", "--workers", "2", "--progress-every",
                        "0", str(ROOT / "examples" / "ctr.py"), "--", "--train", str(tmp_path / "train.tsv"),
                        "--test", str(tmp_path / "test.tsv"), "--epochs", "2"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["test_auc"] > 0.7  # a random model scores 0.5
    assert procs.leftovers() == []


@pytest.mark.cluster
def test_the_jagged_ctr_example_trains_26_tables_of_a_collection_with_trainer(procs, tmp_path):
    data = ROOT / "examples" / "ctr_data.py"
    for name, rows, seed in (("train", 20000, 1), ("test", 4000, 2)):
        subprocess.run([sys.executable, str(data), "--rows", str(rows), "--seed", str(seed), "--vocab", "20000",
                        "--out", str(tmp_path / f"{name}.tsv")], check=True, timeout=120)
    proc = procs.start([sys.executable, "-m", "paramserver", "run", "--ps", "2", "--workers", "2", "--progress-every",
                        "0", "--checkpoint-dir", str(tmp_path / "ckpt"), str(ROOT / "examples" / "ctr_jagged.py"), "--",
                        "--train", str(tmp_path / "train.tsv"), "--test", str(tmp_path / "test.tsv"), "--epochs", "2"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["test_auc"] > 0.7  # a random model scores 0.5
    assert procs.leftovers() == []
    # the final checkpoint, exported and served with no cluster, scores what the trained model scored
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import ctr_jagged
    finally:
        sys.path.remove(str(ROOT / "examples"))
    from paramserver.checkpoint import tools
    model = ctr_jagged.CTRModel()
    ps.serving.load(model, tools.export(str(tmp_path / "ckpt"), None, str(tmp_path / "ctr.safetensors")))
    assert round(ctr_jagged.evaluate(model, str(tmp_path / "test.tsv")), 4) == result["test_auc"]
