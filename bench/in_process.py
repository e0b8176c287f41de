"""A plain `python examples/ctr.py` (in-process shards, the debugger path) against `paramserver run
--ps 1 --workers 1` on the same data, alternated pair by pair.

Both report the training loop's own rate (examples/ctr.py's `worker0_examples_per_s`: examples over
the loop's wall time, parsing and the held-out evaluation excluded). The plain run's figure is caught
by wrapping `Context.report_result`, which has no launcher to hand it to. One JSON line per pair,
then a summary line.

    python bench/in_process.py [--pairs 3] [--rows 400000]
"""

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from paramserver.base.config import Options
from paramserver.launch.local.supervisor import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedding import write_ctr_data  # a sibling benchmark script

CTR = str(Path(__file__).resolve().parents[1] / "examples" / "ctr.py")
# runs a script as `python SCRIPT ARGS` would, printing what it hands to report_result
WRAPPER = """
import json, runpy, sys
from paramserver.worker import context
handed = context.Context.report_result
def report(self, **values):
    print("RESULT " + json.dumps(values), flush=True)
    handed(self, **values)
context.Context.report_result = report
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def in_process(train: str, test: str) -> float:
    out = subprocess.run([sys.executable, "-c", WRAPPER, CTR, "--train", train, "--test", test],
                         capture_output=True, text=True, check=True).stdout
    result = [line for line in out.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(result.removeprefix("RESULT "))["worker0_examples_per_s"]


def one_ps_cluster(train: str, test: str) -> float:
    cluster = LocalCluster(1, 1, CTR, ["--train", train, "--test", test], Options(), out=io.StringIO(),
                           progress_every=0, log_level="WARNING")
    if cluster.run() != 0:
        raise SystemExit(cluster._lines.out.getvalue()[-3000:])
    return cluster.summary()["worker0_examples_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=400_000, help="training lines")
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        train, test = write_ctr_data(tmp, args.rows)
        for pair in range(args.pairs):
            plain, cluster = in_process(train, test), one_ps_cluster(train, test)
            ratios.append(plain / cluster)
            print(json.dumps({"bench": "in_process", "case": "pair", "pair": pair, "in_process_examples_per_s": plain,
                              "cluster_1x1_examples_per_s": cluster, "ratio": round(plain / cluster, 3)}), flush=True)
    print(json.dumps({"bench": "in_process", "case": "summary", "pairs": args.pairs,
                      "ratio_median": round(statistics.median(ratios), 3)}), flush=True)


if __name__ == "__main__":
    main()
