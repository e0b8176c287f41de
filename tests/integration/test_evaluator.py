"""The evaluator task of a TFJob-style cluster (TF's SidecarEvaluator), with real `paramserver node`
processes: it evaluates checkpoints while training runs, its metric for the final checkpoint is
what plain torch computes on the exported model, it writes them to the log and TensorBoard, and it
exits 0 after the final checkpoint: started before any checkpoint exists, after training ended,
or with a function that raises (training unaffected)."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tests.conftest import ROOT
from tests.integration.test_node import applied_pushes
from tests.ports import free_port

from paramserver import load_export
from paramserver.checkpoint import tools
from paramserver.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.cluster  # clusters of processes

SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "train_eval.py")
STEPS = 30  # each worker's; checkpoints every 5 steps, the final one at 30


def tf_config(cluster: dict, role: str, index: int = 0) -> str:
    """What Kubeflow's TFJob controller sets for a replica."""
    return json.dumps({"cluster": cluster, "task": {"type": role, "index": index}, "environment": "cloud"})


def start(procs, cluster, role, *flags, index=0, script_args=()):
    argv = [sys.executable, "-m", "paramserver", "--log-level", "INFO", "node", *flags]
    if role != "ps":
        argv += [SCRIPT, *script_args]
    return procs.start(argv, env=procs.env(TF_CONFIG=tf_config(cluster, role, index)), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)


def heldout(tmp_path) -> str:
    g = torch.Generator().manual_seed(99)
    ids, x = torch.randint(0, 40, (64,), generator=g), torch.randn(64, 8, generator=g)
    path = tmp_path / "heldout.pt"  # ids the workers train on: every one has a row in the checkpoint
    torch.save({"ids": ids, "x": x, "y": (x[:, 0] > 0).long() + (ids % 2 == 0).long()}, path)
    return str(path)


def evaluations(out: str) -> list[dict]:
    """The evaluator's JSON log records of event "evaluation"."""
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r for r in records if r.get("event") == "evaluation"]


def torch_metrics(directory: str, data_path: str, out) -> dict:
    """The held-out metrics of the exported final checkpoint, computed by plain torch."""
    saved = load_export(tools.export(directory, None, str(out)))
    data, state = torch.load(data_path), saved["state_dict"]
    table = saved["embeddings"]["emb"]  # the module's path, as dense names: no optimizer prefix
    where = {int(i): row for row, i in enumerate(table["ids"])}
    rows = table["weight"][[where[int(i)] for i in data["ids"]]]
    hidden = F.relu(F.linear(torch.cat([rows, data["x"]], 1), state["fc1.weight"], state["fc1.bias"]))
    logits = F.linear(hidden, state["fc2.weight"], state["fc2.bias"])
    return {"loss": F.cross_entropy(logits, data["y"]).item(),
            "accuracy": (logits.argmax(1) == data["y"]).float().mean().item()}


def cluster_spec() -> dict:
    return {"ps": [f"localhost:{free_port()}"], "worker": [f"localhost:{free_port()}" for _ in range(2)],
            "evaluator": [f"localhost:{free_port()}"]}


def test_the_evaluator_follows_the_runs_checkpoints_and_ends_after_the_final_one(procs, tmp_path):
    cluster, directory, logdir, markers = cluster_spec(), str(tmp_path / "ckpt"), tmp_path / "tb", tmp_path / "m"
    markers.mkdir()
    data = heldout(tmp_path)
    common = ["--checkpoint-dir", directory]
    script = ["--heldout", data, "--marker-dir", str(markers)]
    evaluator = start(procs, cluster, "evaluator", *common, "--log-format", "json", "--logdir", str(logdir),
                      script_args=script)  # before the PS: no checkpoint exists yet, it waits
    ps_node = start(procs, cluster, "ps", *common)
    workers = [start(procs, cluster, "worker", *common, "--checkpoint-every", "5", index=i,
                     script_args=[*script, "--steps", str(STEPS), *(["--wait-eval-at", "10"] if i == 0 else [])])
               for i in range(2)]
    outputs = [w.communicate(timeout=180)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    out, _ = evaluator.communicate(timeout=120)
    assert evaluator.returncode == 0, out
    done = evaluations(out)
    steps = [r["step"] for r in done]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS and len(steps) >= 2, out  # some while training ran
    store = CheckpointStore(directory)
    assert store.manifest("ckpt-000000030")["final"] is True
    assert any(store.parent(name) for name in store.complete())  # incremental ones among them: chains are read
    expected = torch_metrics(directory, data, tmp_path / "final.pt")
    assert done[-1]["metrics"]["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert done[-1]["metrics"]["accuracy"] == pytest.approx(expected["accuracy"], abs=1e-6)
    assert done[-1]["checkpoint"] == "ckpt-000000030" and done[-1]["role"] == "evaluator"

    events = EventAccumulator(str(logdir / "eval"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/loss")] == steps
    assert events.Scalars("eval/loss")[-1].value == pytest.approx(expected["loss"], rel=1e-5)

    late = start(procs, cluster, "evaluator", *common, "--log-format", "json", script_args=script)
    late_out, _ = late.communicate(timeout=120)  # after training ended: the final checkpoint, and done
    assert late.returncode == 0, late_out
    assert [(r["step"], r["metrics"]["loss"]) for r in evaluations(late_out)] == [(STEPS, done[-1]["metrics"]["loss"])]
    ps_node.terminate()
    assert ps_node.wait(30) == 0


def test_an_evaluator_whose_function_raises_exits_0_and_training_is_unaffected(procs, tmp_path):
    cluster, directory = cluster_spec(), str(tmp_path / "ckpt")
    script = ["--heldout", heldout(tmp_path)]
    ps_node = start(procs, cluster, "ps", "--checkpoint-dir", directory)
    workers = [start(procs, cluster, "worker", "--checkpoint-dir", directory, "--checkpoint-every", "10", index=i,
                     script_args=[*script, "--steps", str(STEPS)]) for i in range(2)]
    evaluator = start(procs, cluster, "evaluator", "--checkpoint-dir", directory, script_args=[*script, "--fail-eval"])
    outputs = [w.communicate(timeout=180)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs
    out, _ = evaluator.communicate(timeout=120)
    assert evaluator.returncode == 0, out
    assert "fails on purpose at step 30" in out and "the evaluation function failed on ckpt-000000030" in out
    assert applied_pushes(cluster["ps"][0]) == 2 * STEPS  # every push of both workers
    assert CheckpointStore(directory).complete()[-1] == "ckpt-000000030"
    ps_node.terminate()
    assert ps_node.wait(30) == 0


def test_an_evaluator_whose_script_fails_or_has_no_checkpoint_dir_exits_0(procs, tmp_path):
    cluster = cluster_spec()
    broken = start(procs, cluster, "evaluator", script_args=["--heldout", "/nonexistent"])  # no --checkpoint-dir
    out, _ = broken.communicate(timeout=120)
    assert broken.returncode == 0, out
    assert "needs the run's checkpoint directory" in out and "never fails the job" in out


def test_run_with_evaluator_starts_one_next_to_the_workers(procs, tmp_path):
    directory = str(tmp_path / "ckpt")
    proc = procs.start([sys.executable, "-m", "paramserver", "run", "--ps", "1", "--workers", "2", "--progress-every",
                        "0", "--checkpoint-dir", directory, "--checkpoint-every", "10", "--evaluator", SCRIPT, "--",
                        "--heldout", heldout(tmp_path), "--steps", str(STEPS)],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert "[evaluator0]" in out and "evaluation of ckpt-000000030 (step 30): loss=" in out, out
    assert "evaluated the final checkpoint ckpt-000000030" in out  # as the final one, or marked final after
    assert procs.leftovers() == []


def test_run_with_a_failing_evaluator_succeeds_and_its_closing_line_says_the_evaluator_failed(procs, tmp_path):
    proc = procs.start([sys.executable, "-m", "paramserver", "run", "--workers", "1", "--progress-every", "0",
                        "--checkpoint-dir", str(tmp_path / "ckpt"), "--evaluator", SCRIPT, "--",
                        "--heldout", heldout(tmp_path), "--steps", "10", "--fail-evaluator"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["evaluator_error"] == "RuntimeError: the evaluator fails on purpose", out
    assert procs.leftovers() == []
