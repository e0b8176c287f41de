"""dense_sync "allreduce": dense variables trained by a gloo all-reduce among real worker processes
(`paramserver run`), the embedding table on the PS; checked against sync PS mode and plain torch."""

import json
import random
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tests.conftest import ROOT

from paramserver.checkpoint.restore import RestoreSource
from paramserver.checkpoint.store import CheckpointStore

pytestmark = pytest.mark.cluster  # whole clusters of processes
SCRIPT = str(ROOT / "tests" / "integration" / "scripts" / "train_hybrid.py")
IDS, FEATURES, DIM = 20, 6, 4


def batch(worker: int, step: int):
    """As train_hybrid.py's `batch`."""
    g = torch.Generator().manual_seed(1000 * worker + step)
    return (torch.randint(0, IDS, (8,), generator=g), torch.randn(8, FEATURES, generator=g),
            torch.randn(8, 1, generator=g))


def run(procs, out, *flags: str, workers: int = 2, ps: int = 2, script_args=()) -> dict:
    out.mkdir()
    proc = procs.start([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "run", "--ps", str(ps),
                        "--workers", str(workers), *flags, SCRIPT, "--", "--frozen", "--out", str(out),
                        *script_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    text, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, text
    saved = [torch.load(out / f"w{i}.pt") for i in range(workers)]
    return {"summary": json.loads(text.strip().splitlines()[-1]), "saved": saved, "log": text}


def reference(rows: torch.Tensor, counts: list[int], optimizer: str, lr: float) -> dict[str, torch.Tensor]:
    """Plain torch, one process: at step s the batches of the workers that still have data, together
    (equal batch sizes: the mean over them is the mean of the workers' mean gradients)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(DIM + FEATURES, 8), nn.ReLU(), nn.Linear(8, 1))
    emb = nn.Embedding.from_pretrained(rows, freeze=True)
    opt = getattr(torch.optim, optimizer)(mlp.parameters(), lr=lr)
    for step in range(max(counts)):
        parts = [batch(worker, step) for worker, count in enumerate(counts) if step < count]
        ids, x, y = (torch.cat(column) for column in zip(*parts))
        opt.zero_grad()
        F.mse_loss(mlp(torch.cat([emb(ids), x], 1)), y).backward()
        opt.step()
    return dict(mlp.named_parameters())


def assert_close(got: dict, want: dict, **tolerance) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name].detach(), **tolerance, msg=lambda m: f"{name}: {m}")


def test_allreduce_equals_sync_ps_mode_and_plain_torch(procs, tmp_path):
    allreduce = run(procs, tmp_path / "allreduce", "--mode", "sync", "--dense-sync", "allreduce")
    on_ps = run(procs, tmp_path / "ps", "--mode", "sync")
    first, second = (saved["dense"] for saved in allreduce["saved"])
    for name in first:  # every worker applies the same average with the same optimizer
        assert torch.equal(first[name], second[name]), name
    assert_close(first, on_ps["saved"][0]["dense"], rtol=1e-6, atol=1e-7)
    rows = allreduce["saved"][0]["rows"]
    assert torch.equal(rows, on_ps["saved"][0]["rows"])  # the frozen table: the same initial rows
    assert_close(first, reference(rows, [10, 10], "SGD", 0.1), rtol=1e-5, atol=1e-6)
    assert procs.leftovers() == []


def test_uneven_ends_finish_average_over_real_contributors_and_checkpoint_the_dense_values(procs, tmp_path):
    # each worker reads a batch ahead (its data ends before its last step), both meet at a barrier after
    # 4 batches (or at the end of fewer) and at the end; the chief may have no batch at all; the table in
    # sync mode: a worker stepping out must not hold the others' PS steps
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    counts = sorted((rng.randint(0, 12), rng.randint(1, 12)))  # the chief, done first, answers the other's steps
    print(f"batches per worker: {counts}")
    ckpt = tmp_path / "ckpt"
    result = run(procs, tmp_path / "out", "--mode", "sync", "--dense-sync", "allreduce", "--checkpoint-dir", str(ckpt),
                 "--checkpoint-every", "3", ps=1, script_args=("--counts", ",".join(map(str, counts)), "--lookahead",
                                                               "--mid-barrier", "4",
                                                               "--optimizer", "Adam", "--lr", "0.01"))
    assert [saved["trained"] for saved in result["saved"]] == counts, f"seed {seed}"
    first, second = (saved["dense"] for saved in result["saved"])
    for name in first:
        assert torch.equal(first[name], second[name]), (name, f"seed {seed}")
    assert_close(first, reference(result["saved"][0]["rows"], counts, "Adam", 0.01), rtol=1e-5, atol=1e-6)
    store = CheckpointStore(str(ckpt))
    final = RestoreSource(store, store.complete()[-1])
    assert final.manifest.get("final") is True, f"seed {seed}"
    saved = {var.removeprefix("opt0."): dense.value for var, dense in final.dense_variables()["opt0.group0"]["vars"].items()}
    for name, value in first.items():  # the chief wrote its values, after the other's last steps
        assert torch.equal(torch.from_numpy(saved[f"mlp.{name}"]), value), (name, f"seed {seed}")
    assert procs.leftovers() == [], f"seed {seed}"


def test_a_worker_that_dies_rolls_the_cluster_back_to_its_checkpoint_with_the_dense_values(procs, tmp_path):
    # worker 1 dies after step 5; worker 0's all-reduce fails (its peer's connections close), it asks for
    # the roll-back, and the cluster resumes from checkpoint 3, whose dense values the chief wrote
    result = run(procs, tmp_path / "out", "--dense-sync", "allreduce", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--checkpoint-every", "3", ps=1, script_args=("--steps", "8", "--die-after", "5"))
    assert "rolling the whole cluster back" in result["log"], result["log"]
    assert [saved["trained"] for saved in result["saved"]] == [5, 5]  # batches 4 to 8, after the restore
    first, second = (saved["dense"] for saved in result["saved"])
    for name in first:
        assert torch.equal(first[name], second[name]), name
    # plain SGD keeps no optimizer state: the interrupted run ends where an uninterrupted one does
    assert_close(first, reference(result["saved"][0]["rows"], [8, 8], "SGD", 0.1), rtol=1e-5, atol=1e-6)
    assert procs.leftovers() == []


@pytest.mark.parametrize("flags, message", [
    (("--checkpoint-dir", "CKPT", "--checkpoint-every-seconds", "5"), "'checkpoint_every_seconds' needs dense_sync"),
    (("--mode", "sync", "--backup-workers", "1"), "'backup_workers' needs dense_sync"),
])
def test_bad_combinations_are_refused_before_anything_starts(procs, tmp_path, flags, message):
    flags = [str(tmp_path) if flag == "CKPT" else flag for flag in flags]
    proc = procs.start([sys.executable, "-m", "paramserver", "run", "--workers", "3", "--dense-sync", "allreduce",
                        *flags, SCRIPT, "--", "--out", str(tmp_path)], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and message in text, text
    assert procs.leftovers() == []
