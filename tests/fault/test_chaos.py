"""Chaos: kill -9 a worker, then a PS, then the chief while digits train with checkpoints every
20 steps; the run must finish by itself with the accuracy of an undisturbed run. A PS killed
while it writes a checkpoint: the previous checkpoint is what the cluster comes back from. A
killed worker other than the chief is restarted alone while the others go on, in every mode.

Sync mode makes training deterministic given each worker's data position, so a run that rolled
back (or restarted a worker alone) ends at the undisturbed run's accuracy (within float
summation order).
"""

import random
import time

import pytest
from tests.fault.launcher_run import LauncherRun

pytestmark = pytest.mark.fault  # three short digits runs: about a minute

DIGITS = "examples/digits.py"


def Run(procs, *flags: str, epochs: int = 6) -> LauncherRun:
    """examples/digits.py on 2 PS + 2 workers (sync unless `flags` set a mode)."""
    mode = [] if "--mode" in flags else ["--mode", "sync"]
    return LauncherRun(procs, ["--ps", "2", "--workers", "2", *mode, *flags], DIGITS, ["--epochs", str(epochs)])


def test_killing_a_worker_a_ps_and_the_chief_costs_no_accuracy(procs, tmp_path):
    undisturbed_run = Run(procs)  # beside the disturbed run, whose kills wait for its own lines, not for a time
    seed = int(time.time())
    rng = random.Random(seed)
    victims = [f"worker{rng.randrange(2)}", f"ps{rng.randrange(2)}", "worker0"]
    run = Run(procs, "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "20")
    seen = 0
    for restart, victim in enumerate(victims, 1):
        seen = run.wait_for("ckpt-", seen)
        seen = run.wait_for(": committed", seen) + 1
        run.kill(victim)
        seen = run.wait_for(f"(restart {restart} of 3)", seen) + 1
        if victim != "worker1":  # a PS or the chief: the cluster rolls back; worker 1 restarts alone
            seen = run.wait_for("cluster restarted", seen) + 1
    summary, undisturbed = run.finish(), undisturbed_run.finish()
    log = "".join(run.lines)
    rollbacks = sum(victim != "worker1" for victim in victims)
    assert log.count("rolling the whole cluster back") == rollbacks and "resuming from ckpt-" in log, (seed, victims)
    assert log.count("restarting it alone") == 3 - rollbacks, (seed, victims)
    assert abs(summary["test_accuracy"] - undisturbed["test_accuracy"]) <= 0.01, (seed, victims, summary,
                                                                                   undisturbed)
    assert procs.leftovers() == [], (seed, victims)


def test_a_ps_killed_while_writing_a_checkpoint_leaves_the_previous_one_to_resume_from(procs, tmp_path):
    directory = tmp_path / "ckpt"
    run = Run(procs, "--checkpoint-dir", str(directory), "--checkpoint-every", "20", epochs=4)
    seen = run.wait_for("ckpt-000000020: committed") + 1
    seen = run.wait_for("ckpt-000000040: writing", seen) + 1
    run.kill("ps1")  # the checkpoint at step 40 is being written (or about to be)
    seen = run.wait_for("resuming from ckpt-", seen)
    resumed_from = run.lines[seen].split("resuming from ")[1].split()[0]
    summary = run.finish()
    assert resumed_from in ("ckpt-000000020", "ckpt-000000040")  # 40 only if its manifest made it to disk
    if resumed_from == "ckpt-000000020":
        assert "ckpt-000000040: committed" not in "".join(run.lines[:seen])
    assert summary["test_accuracy"] > 0.9
    assert procs.leftovers() == []


@pytest.mark.parametrize("mode", [["--mode", "async"], ["--mode", "sync", "--backup-workers", "1"]],
                         ids=["async", "sync-with-a-backup"])
def test_a_killed_worker_is_restarted_alone_and_the_others_never_stop(procs, mode):
    run = Run(procs, *mode, epochs=8)
    seen = run.wait_for("[worker1] epoch 2/8") + 1
    run.kill("worker1")
    seen = run.wait_for("restarting it alone", seen) + 1
    resumed = run.wait_for("[worker1]", seen)
    resumed = run.wait_for("resuming at step", resumed)
    step = int(run.lines[resumed].split("resuming at step ")[1].split()[0])
    summary = run.finish()
    log = "".join(run.lines)
    assert step >= 2 * 23  # two epochs of 23 batches were done: its data goes on from there
    # (async: where the PS counted its pushes; sync: the cluster's current step, as a backup joins)
    assert "rolling the whole cluster back" not in log and "resuming from ckpt" not in log
    assert log.count("[worker0] epoch ") == 8  # worker 0 never restarted: one run through its epochs
    assert summary["test_accuracy"] > 0.9
    assert procs.leftovers() == []
