"""examples/ctr.py with its embedding table in memory and with a memory budget that forces most of
its rows to disk (tiered), back to back on the same generated data: examples/s, held-out AUC, the
PS's peak RSS. One JSON line per run, then one with the ratios.

    python bench/ctr_tiered.py [--rows 200000] [--budget 8MiB] [--repeat 2] [--ps 1 --workers 1]
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedding import run_ctr, write_ctr_data

from paramserver.base.byte_size import parse_byte_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000, help="training lines (a tenth more to test)")
    parser.add_argument("--budget", default="8MiB", help="table memory budget of each PS in the tiered runs")
    parser.add_argument("--repeat", type=int, default=2, help="alternating pairs of runs")
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"memory": [], "tiered": []}
    with tempfile.TemporaryDirectory() as tmp:
        train, test = write_ctr_data(tmp, args.rows)
        for _ in range(args.repeat):
            for kind in ("memory", "tiered"):
                options = {}
                if kind == "tiered":
                    spill = Path(tmp) / "spill"
                    spill.mkdir(exist_ok=True)
                    options = {"table_memory_budget": parse_byte_size(args.budget), "spill_dir": str(spill)}
                record = run_ctr(args.ps, args.workers, [], train, test, options=options)
                record.update(kind=kind, budget=args.budget if kind == "tiered" else None)
                runs[kind].append(record)
                print(json.dumps(record), flush=True)
    speed = {kind: statistics.median(r["examples_per_s"] for r in rs) for kind, rs in runs.items()}
    auc = {kind: statistics.median(r["test_auc"] for r in rs) for kind, rs in runs.items()}
    print(json.dumps({"bench": "ctr_tiered", "ps": args.ps, "workers": args.workers, "budget": args.budget,
                      "examples_per_s": speed, "tiered_vs_memory": round(speed["tiered"] / speed["memory"], 3),
                      "test_auc": auc, "auc_difference": round(auc["tiered"] - auc["memory"], 4)}), flush=True)


if __name__ == "__main__":
    main()
