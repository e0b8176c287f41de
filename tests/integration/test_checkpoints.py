"""Checkpoints with real clusters: a resumed run ends where an uninterrupted one ends, on more or
fewer PS than wrote the checkpoint; damaged checkpoints are skipped; the CLI reads them; a clean
end of training writes the final checkpoint, which export turns into the trained model."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from tests.conftest import ROOT
from tests.unit.test_checkpoint_trust import rewrite

from paramserver import load_export
from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.cluster  # several short clusters: ~60 s

SCRIPTS = ROOT / "tests" / "integration" / "scripts"
RESUME = str(SCRIPTS / "train_resume.py")


def run(procs, num_ps: int, *flags: str, steps: int = 20, script: str = RESUME, workers: int = 1,
        args: tuple[str, ...] = ()) -> dict:
    return finish(start(procs, num_ps, *flags, steps=steps, script=script, workers=workers, args=args))


def start(procs, num_ps: int, *flags: str, steps: int = 20, script: str = RESUME, workers: int = 1,
          args: tuple[str, ...] = ()) -> subprocess.Popen:
    return procs.start([sys.executable, "-m", "paramserver", "run", "--ps", str(num_ps), "--workers", str(workers),
                        "--progress-every", "0", *flags, script, "--", "--steps", str(steps), *args],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen) -> dict:
    """The closing summary of a run `start` started, which must succeed, with its output as "log"."""
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
    fresh = start(procs, resumed_on, steps=20)  # beside the others: a run's end depends on no timing
    whole = run(procs, written_by, "--checkpoint-dir", directory, "--checkpoint-every", "10")
    assert whole["resumed_from"] == 0
    shutil.rmtree(tmp_path / "ckpt" / "ckpt-000000020")  # as if the job had died after step 10's checkpoint
    resumed = run(procs, resumed_on, "--checkpoint-dir", directory, "--resume")
    assert resumed["resumed_from"] == 10
    assert "resuming from ckpt-000000010" in resumed["log"]
    same_end(resumed, whole)  # dense values, Adam state, step counts and table rows all came back
    same_end(finish(fresh), whole)  # (and the number of PS does not change the math)
    assert procs.leftovers() == []


def test_a_run_resumed_from_a_chain_of_deltas_on_other_ps_ends_where_an_uninterrupted_run_ends(procs, tmp_path):
    directory = str(tmp_path / "ckpt")
    whole = run(procs, 2, "--checkpoint-dir", directory, "--checkpoint-every", "5", "--keep", "10")
    listed = [json.loads(line) for line in cli("list", directory).stdout.splitlines()]
    # (a small model whose rows all change: its deltas are as large as a base, so a new base follows)
    assert [(row["step"], row["kind"], row["status"]) for row in listed][:2] == [(5, "base", "ok"), (10, "delta", "ok")]
    for step in (15, 20):  # as if the job had died after step 10's checkpoint
        shutil.rmtree(tmp_path / "ckpt" / f"ckpt-0000000{step}")
    resumed = run(procs, 3, "--checkpoint-dir", directory, "--resume")
    assert resumed["resumed_from"] == 10
    assert "a chain of ckpt-000000005 + ckpt-000000010" in resumed["log"]
    same_end(resumed, whole)  # dense values, optimizer state, step counts and table rows all came back
    assert procs.leftovers() == []


def _set_nan(arrays: dict) -> None:
    name = next(key for key in sorted(arrays) if key.startswith("dense/") and arrays[key].size)
    arrays[name].reshape(-1)[0] = np.nan


@pytest.mark.parametrize("meta, tensors, reason", [
    (lambda d: d.pop("groups"), None, "groups: Field required"),
    (lambda d: d.update(positions={"0": "5"}), None, "positions.0"),
    (None, _set_nan, "holds NaN or infinite values"),
], ids=["groups-missing", "position-a-string", "nan"])
def test_resume_falls_back_from_a_crafted_checkpoint_to_the_one_before(procs, tmp_path, thirty_steps_copy, meta,
                                                                       tensors, reason):
    directory, whole = tmp_path / "ckpt", thirty_steps_copy  # 30 steps on 2 PS, checkpoints at 10, 20, 30
    rewrite(directory, 0, meta, tensors, name="ckpt-000000030")  # its manifest matches: only the check refuses it
    listed = {row["name"]: row["status"] for row in map(json.loads, cli("list", str(directory)).stdout.splitlines())}
    assert listed["ckpt-000000020"] == "ok" and reason in listed["ckpt-000000030"], listed
    resumed = run(procs, 2, "--checkpoint-dir", str(directory), "--resume", steps=30)
    assert resumed["resumed_from"] == 20 and "cannot resume from ckpt-000000030" in resumed["log"]
    assert reason in resumed["log"]
    same_end(resumed, whole)  # every PS chose the same checkpoint, and it was restored whole
    assert procs.leftovers() == []


def test_resume_skips_a_damaged_checkpoint_and_the_cli_names_the_file(procs, tmp_path, thirty_steps_copy):
    directory, whole = str(tmp_path / "ckpt"), thirty_steps_copy  # 30 steps on 2 PS, checkpoints at 10, 20, 30
    latest = tmp_path / "ckpt" / "ckpt-000000030" / "shard-1.safetensors"
    data = bytearray(latest.read_bytes())
    data[20] ^= 0xFF  # one flipped byte in the newest checkpoint's header (damage in rows: a named error on load)
    latest.write_bytes(bytes(data))
    rows = [json.loads(line) for line in cli("list", directory).stdout.splitlines()]
    listed = {row["name"]: row["status"] for row in rows}
    assert listed == {"ckpt-000000010": "ok", "ckpt-000000020": "ok",
                      "ckpt-000000030": "damaged: shard file shard-1.safetensors does not match its SHA-256 "
                                        "(changed after it was written)"}
    bad = cli("inspect", directory, "ckpt-000000030")
    assert bad.returncode == 2 and "shard-1.safetensors" in bad.stderr and "SHA-256" in bad.stderr
    resumed = run(procs, 2, "--checkpoint-dir", directory, "--resume", steps=30)
    assert resumed["resumed_from"] == 20 and "cannot resume from ckpt-000000030" in resumed["log"]
    same_end(resumed, whole)

    exported = cli("export", directory, "ckpt-000000020", "--out", str(tmp_path / "model.pt"))
    assert exported.returncode == 0, exported.stderr
    saved = load_export(tmp_path / "model.pt")
    assert saved["step"] == 20 and set(saved["state_dict"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert saved["state_dict"]["0.weight"].shape == (16, 8)
    table = saved["embeddings"]["resume.table"]
    assert table["weight"].shape == (table["ids"].shape[0], 4) and set(table["ids"].tolist()) <= set(range(50))


def test_timed_checkpoints_keep_each_async_workers_own_position(procs, tmp_path):
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
    assert store.complete()[-1] == "ckpt-000000080"  # the final checkpoint: every worker's data is done
    assert RestoreSource(store, "ckpt-000000080").positions == {0: 80, 1: 80}
    shutil.rmtree(tmp_path / "ckpt" / "ckpt-000000080")  # as if the job had died before its end
    assert len(store.complete()) >= 1
    source = RestoreSource(store, store.complete()[-1])
    positions = source.positions
    assert set(positions) == {0, 1} and 0 < min(positions.values()) and max(positions.values()) <= 80
    assert positions[0] != positions[1]  # async workers at different speeds: each has its own position
    resumed = run_positions("--resume")
    assert resumed["worker0_resumed_at"] == positions[0] and resumed["worker1_resumed_at"] == positions[1]


def export_file(directory: str, out) -> tuple[dict, subprocess.CompletedProcess]:
    exported = cli("export", directory, "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout.strip() == str(out)
    return load_export(out), exported


def test_a_clean_end_writes_the_final_checkpoint_and_export_gives_the_trained_model(procs, tmp_path):
    only_final = str(tmp_path / "final")
    end = run(procs, 2, "--checkpoint-dir", only_final, steps=23)  # no period: the final checkpoint alone
    assert end["checkpoints_written"] == 1 and end["checkpoints_failed"] == 0
    assert [json.loads(line)["name"] for line in cli("list", only_final).stdout.splitlines()] == ["ckpt-000000023"]
    saved, exported = export_file(only_final, tmp_path / "model.pt")
    assert saved["step"] == 23 and set(saved["state_dict"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert "positional" not in exported.stderr
    dense = sum(t.double().sum().item() for t in saved["state_dict"].values())
    assert dense == pytest.approx(end["dense_checksum"], abs=1e-5)  # the values the worker ended with
    table = saved["embeddings"]["resume.table"]
    assert sorted(table["ids"].tolist()) == list(range(50))  # the rows the script read at its end
    assert table["weight"].double().abs().sum().item() == pytest.approx(end["table_checksum"], abs=1e-5)

    periodic = str(tmp_path / "periodic")
    run(procs, 2, "--checkpoint-dir", periodic, "--checkpoint-every", "10", steps=23)
    assert CheckpointStore(periodic).complete() == ["ckpt-000000010", "ckpt-000000020", "ckpt-000000023"]
    assert export_file(periodic, tmp_path / "periodic.pt")[0]["step"] == 23

    shutil.rmtree(tmp_path / "periodic" / "ckpt-000000023")  # as if the job had died after step 20's checkpoint
    resumed = run(procs, 3, "--checkpoint-dir", periodic, "--resume", steps=23)
    assert resumed["resumed_from"] == 20
    same_end(resumed, end)
    assert CheckpointStore(periodic).complete() == ["ckpt-000000010", "ckpt-000000020", "ckpt-000000023"]
    assert procs.leftovers() == []


def test_the_final_checkpoint_holds_the_steps_of_workers_that_trained_on_after_the_chief(procs, tmp_path):
    directory = str(tmp_path / "ckpt")
    end = run(procs, 2, "--checkpoint-dir", directory, "--checkpoint-every", "10", workers=2, steps=20,
              script=str(SCRIPTS / "train_uneven.py"), args=("--extra", "15"))
    assert end["worker0_steps"] == 20 and end["worker1_steps"] == 35
    store = CheckpointStore(directory)
    # worker 1 passed step 30 alone (the chief was past its data): no checkpoint there; the final
    # one has the chief's step, and replaced the periodic checkpoint of that step
    assert store.complete() == ["ckpt-000000010", "ckpt-000000020"]
    assert RestoreSource(store, "ckpt-000000020").positions == {0: 20, 1: 35}
    saved, _ = export_file(directory, tmp_path / "model.pt")
    assert saved["step"] == 20
    assert sum(t.double().sum().item() for t in saved["state_dict"].values()) == pytest.approx(end["checksum"],
                                                                                                 abs=1e-5)


def test_export_of_unnamed_parameters_says_so_and_its_recipe_loads_the_model(procs, tmp_path):
    directory = str(tmp_path / "ckpt")
    proc = procs.start([sys.executable, "-m", "paramserver", "run", "--ps", "2", "--workers", "1",
                        "--progress-every", "0", "--checkpoint-dir", directory,
                        str(SCRIPTS / "train_small.py"), "--", "--steps", "15"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    checksum = float(out.split("worker 0/1 done: checksum ")[1].split()[0])
    saved, exported = export_file(directory, tmp_path / "model.pt")
    assert saved["step"] == 15 and list(saved["state_dict"]) == ["param0", "param1", "param2", "param3"]
    note = exported.stderr
    assert "positional" in note and "ps.optim.Adam(model.named_parameters(), ...)" in note
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))  # train_small's
    recipe = "\n".join(line[4:] for line in note.splitlines() if line.startswith("    ") and "ps.optim" not in line)
    exec(recipe, {"torch": torch, "model": model})
    assert sum(p.double().sum().item() for p in model.parameters()) == pytest.approx(checksum, abs=1e-5)
