"""Hybrid dense sync: examples/ctr.py on 2 PS + 2 workers, dense variables on the PS (default) vs
all-reduced among the workers (`--dense-sync allreduce`), back to back in one run.

Synthetic Criteo-format data (examples/ctr_data.py): --rows for training, a tenth of that held out.
One JSON line: each mode's examples/s (the launcher's, all workers together) and held-out AUC, and the
allreduce / ps ratio of examples/s.

    python bench/hybrid.py [--rows 100000] [--mode async|sync]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(train: Path, test: Path, mode: str, dense_sync: str) -> dict:
    """One `paramserver run` of examples/ctr.py; its closing JSON line."""
    proc = subprocess.run([sys.executable, "-m", "paramserver", "--log-level", "WARNING", "run", "--ps", "2",
                           "--workers", "2", "--mode", mode, "--dense-sync", dense_sync, "--progress-every", "0",
                           str(ROOT / "examples" / "ctr.py"), "--", "--train", str(train), "--test", str(test)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{dense_sync} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--mode", default="async", help="the PS's consistency mode (the tables' in allreduce)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        train, test = Path(tmp) / "train.tsv", Path(tmp) / "test.tsv"
        for path, rows, seed in ((train, args.rows, 1), (test, max(1000, args.rows // 10), 2)):
            subprocess.run([sys.executable, str(ROOT / "examples" / "ctr_data.py"), "--rows", str(rows),
                            "--seed", str(seed), "--out", str(path)], check=True, capture_output=True)
        results = {dense_sync: run(train, test, args.mode, dense_sync) for dense_sync in ("ps", "allreduce")}
    figures = {"rows": args.rows, "mode": args.mode, "ps": 2, "workers": 2}
    for dense_sync, summary in results.items():
        figures[f"{dense_sync}_examples_per_s"] = summary["examples_per_s"]
        figures[f"{dense_sync}_test_auc"] = summary.get("test_auc")
        figures[f"{dense_sync}_wall_s"] = summary["wall_s"]
    figures["allreduce_over_ps_examples_per_s"] = round(
        results["allreduce"]["examples_per_s"] / results["ps"]["examples_per_s"], 3)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
