"""Consistency modes: throughput, stragglers, and convergence. One JSON line per case.

- throughput: the seed MLP (batch 64 per worker, Adam, 1 PS, 2 workers) in async, sync, ssp:2;
- stragglers: 3 workers, one slowed to 1/3 speed (a sleep in its step): sync without and with
  the straggler, sync with 1 backup worker, async; `backup_vs_clean_sync` is the share of the
  straggler-free sync throughput that sync with a backup keeps (target >= 0.8);
- convergence: held-out accuracy on the digits after the same number of examples, per mode.

    python bench/consistency.py [--seconds 8] [--epochs 10] [--plot bench/out/consistency.png]
"""

import argparse
import io
import json
from pathlib import Path

from paramserver.base.config import Options
from paramserver.launch.local.supervisor import LocalCluster, default_torch_threads

BENCH = Path(__file__).resolve().parent
WORKER = str(BENCH / "dense_worker.py")
DIGITS = str(BENCH.parent / "examples" / "digits.py")


def run(script: str, args: list[str], workers: int, mode: str, backups: int = 0) -> dict:
    options = Options(torch_threads=default_torch_threads(workers), mode=mode, backup_workers=backups)
    cluster = LocalCluster(1, workers, script, args, options, out=io.StringIO(), progress_every=0,
                           log_level="WARNING")
    if cluster.run() != 0:
        raise SystemExit(f"{mode} with {workers} workers failed:\n{cluster._lines.out.getvalue()[-3000:]}")
    return cluster.summary()


def throughput(seconds: float, workers: int, mode: str, backups: int = 0, slow: int = -1) -> float:
    summary = run(WORKER, ["--seconds", str(seconds), "--slow-worker", str(slow)], workers, mode, backups)
    return round(sum(summary[f"worker{i}_examples_per_s"] for i in range(workers)), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="timed seconds per throughput case")
    parser.add_argument("--epochs", type=int, default=10, help="digits epochs for the convergence cases")
    parser.add_argument("--plot", help="write a PNG of the throughput cases here (needs matplotlib)")
    args = parser.parse_args()
    results = []

    def emit(record: dict) -> None:
        results.append(record)
        print(json.dumps(record), flush=True)

    for mode in ("async", "sync", "ssp:2"):
        emit({"bench": "consistency", "case": "throughput", "mode": mode, "ps": 1, "workers": 2,
              "examples_per_s": throughput(args.seconds, 2, mode)})
    clean = throughput(args.seconds, 3, "sync")
    straggler = {"sync": throughput(args.seconds, 3, "sync", slow=2),
                 "sync+1 backup": throughput(args.seconds, 3, "sync", 1, slow=2),
                 "async": throughput(args.seconds, 3, "async", slow=2)}
    emit({"bench": "consistency", "case": "stragglers", "workers": 3, "slow_worker_speed": "1/3",
          "sync_without_straggler": clean, **{k: v for k, v in straggler.items()},
          "backup_vs_clean_sync": round(straggler["sync+1 backup"] / clean, 3)})
    for mode in ("async", "sync", "ssp:2"):
        summary = run(DIGITS, ["--epochs", str(args.epochs)], 2, mode)
        emit({"bench": "consistency", "case": "convergence", "mode": mode, "workers": 2, "epochs": args.epochs,
              "examples": summary["examples"], "test_accuracy": summary["test_accuracy"],
              "wall_s": summary["wall_s"]})
    if args.plot:
        plot(results, args.plot)


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = [], []
    for r in results:
        if r["case"] == "throughput":
            labels.append(f"{r['mode']} (2W)")
            values.append(r["examples_per_s"])
        elif r["case"] == "stragglers":
            for key in ("sync_without_straggler", "sync", "sync+1 backup", "async"):
                labels.append(f"3W straggler: {key}")
                values.append(r[key])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(labels, values)
    ax.set_xlabel("examples/s")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")


if __name__ == "__main__":
    main()
