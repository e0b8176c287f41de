"""Partial recovery against the roll-back: examples/ctr.py, 2 PS + 2 workers, checkpoints every N
steps, one PS killed with -9 mid-run (a seeded delay after a checkpoint).

Three runs of `paramserver run` on the same data: undisturbed; `--recovery partial` (the killed PS
restores its own shard, the rest goes on); `--recovery rollback` (the default: the whole cluster
goes back to the checkpoint). For each disturbed one: seconds from the kill to the next step
trained (the first step a worker finishes after the recovery), steps redone, steps the shard lost,
held-out AUC and its difference from the undisturbed run's. One JSON line.

    python bench/partial_recovery.py [--rows 100000] [--every 50] [--seed 1]
"""

import argparse
import json
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from recovery import wait_for  # a sibling module

_WAIT_S = 900  # a CTR run under load takes minutes to its first checkpoint

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "bench" / "partial_recovery_worker.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="training rows (the test set: a tenth)")
    parser.add_argument("--every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1, help="the kill's delay after the first checkpoint")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = make_data(Path(tmp), args.rows)
        ctr = ["--train", data["train"], "--test", data["test"], "--batch-size", str(args.batch_size),
               "--table-rows", "100000"]
        delay = random.Random(args.seed).uniform(0.5, 2.0)
        result = {"bench": "partial_recovery", "rows": args.rows, "checkpoint_every": args.every,
                  "kill_delay_s": round(delay, 2)}
        undisturbed = run(Path(tmp) / "undisturbed", ctr, args.every, None, delay)
        result.update(undisturbed_auc=undisturbed["test_auc"], undisturbed_wall_s=undisturbed["wall_s"])
        for recovery in ("partial", "rollback"):
            measured = run(Path(tmp) / recovery, ctr, args.every, recovery, delay)
            measured["auc_delta"] = round(measured["test_auc"] - undisturbed["test_auc"], 4)
            result[recovery] = measured
    print(json.dumps(result), flush=True)


def make_data(tmp: Path, rows: int) -> dict[str, str]:
    paths = {}
    for name, count, seed in (("train", rows, 1), ("test", rows // 10, 2)):
        paths[name] = str(tmp / f"{name}.tsv")
        subprocess.run([sys.executable, str(ROOT / "examples" / "ctr_data.py"), "--rows", str(count), "--vocab",
                        "50000", "--seed", str(seed), "--out", paths[name]], check=True, timeout=600)
    return paths


def run(directory: Path, ctr: list[str], every: int, recovery: str | None, delay: float) -> dict:
    """One run; with `recovery`, ps1 is killed `delay` seconds after the first checkpoint committed."""
    flags = ["--ps", "2", "--workers", "2", "--progress-every", "0", "--checkpoint-dir", str(directory),
             "--checkpoint-every", str(every)] + (["--recovery", recovery] if recovery else [])
    proc = subprocess.Popen([sys.executable, "-m", "paramserver", "run", *flags, WORKER, "--", *ctr],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        measured = {} if recovery is None else kill_and_time(proc, lines, recovery, delay)
        proc.wait(1800)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    reader.join(30)
    if proc.returncode != 0:
        raise SystemExit(f"run ({recovery or 'undisturbed'}) failed with {proc.returncode}:\n" + "".join(lines[-40:]))
    summary = json.loads(lines[-1])
    measured.update(test_auc=summary["test_auc"], steps=summary["steps"], wall_s=summary["wall_s"],
                    steps_redone=summary.get("steps_redone", 0))
    if recovery == "partial":
        [entry] = summary.get("partial_recoveries") or [{"steps_lost": None, "checkpoint": None}]
        measured.update(steps_lost=entry["steps_lost"], restored_from=entry["checkpoint"])
    return measured


def kill_and_time(proc: subprocess.Popen, lines: list[str], recovery: str, delay: float) -> dict:
    committed = wait_for(lines, r": committed", timeout=_WAIT_S)
    time.sleep(delay)
    ps_node = next(c for c in psutil.Process(proc.pid).children()
                   if "--role ps --index 1" in " ".join(c.cmdline()))
    killed_at = time.time()
    ps_node.kill()
    back = wait_for(lines, r"is back, restored from" if recovery == "partial" else r"cluster restarted in",
                    committed, _WAIT_S)
    step = wait_for(lines, r"\] STEP \d+ ", back, _WAIT_S)
    return {"kill_to_next_step_s": round(float(lines[step].split()[-1]) - killed_at, 2)}


if __name__ == "__main__":
    main()
