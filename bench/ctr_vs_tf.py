"""examples/ctr.py against TensorFlow's ParameterServerStrategy, alternated run by run.

This machine's speed drifts by tens of percent within minutes, so a ratio is only meaningful
between runs made back to back. For each of `--pairs` rounds and each topology, this runs
examples/ctr.py (with `--flags`) on a local cluster and then bench/tf_reference.py with the
TensorFlow interpreter given by `--tf-python`, and prints one JSON line per pair (both
examples/s and their ratio), then one summary line per topology (median and range of the ratios,
and the ratio of the means).

    python bench/ctr_vs_tf.py --tf-python /tmp/tfvenv/bin/python [--pairs 5] [--flags=--overlap]
        [--topologies 1x1,2x2] [--rows 200000]

(see bench/tf_reference.py for making that TensorFlow virtual environment)
"""

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedding import run_ctr, write_ctr_data  # noqa: E402  (a sibling benchmark script)

HERE = Path(__file__).resolve().parent


def tensorflow_rate(tf_python: str, num_ps: int, workers: int, train: str, test: str) -> float:
    out = subprocess.run([tf_python, str(HERE / "tf_reference.py"), "--train", train, "--test", test,
                          "--topologies", f"{num_ps}x{workers}"], check=True, capture_output=True, text=True).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["examples_per_s"]


def summary(topology: str, flags: str, pairs: list[dict]) -> dict:
    ratios = [p["ratio"] for p in pairs]
    ours = statistics.mean(p["paramserver_examples_per_s"] for p in pairs)
    theirs = statistics.mean(p["tensorflow_examples_per_s"] for p in pairs)
    return {"bench": "ctr_vs_tf", "case": "summary", "topology": topology, "flags": flags, "pairs": len(pairs),
            "ratio_median": round(statistics.median(ratios), 3), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ratio_of_means": round(ours / theirs, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tf-python", required=True, help="python of a virtual environment with TensorFlow 2.21")
    parser.add_argument("--pairs", type=int, default=5, help="alternated pairs of runs per topology")
    parser.add_argument("--flags", default="", help="examples/ctr.py flags, e.g. --flags=--overlap")
    parser.add_argument("--topologies", default="1x1,2x2", help="PSxWORKERS, comma separated")
    parser.add_argument("--rows", type=int, default=200_000, help="training lines")
    args = parser.parse_args()
    topologies = [tuple(int(n) for n in t.split("x")) for t in args.topologies.split(",")]
    flags = shlex.split(args.flags)
    results: dict[str, list[dict]] = {f"{p}x{w}": [] for p, w in topologies}
    with tempfile.TemporaryDirectory() as tmp:
        train, test = write_ctr_data(tmp, args.rows)
        for pair in range(args.pairs):
            for num_ps, workers in topologies:
                ours = run_ctr(num_ps, workers, flags, train, test)["examples_per_s"]
                theirs = tensorflow_rate(args.tf_python, num_ps, workers, train, test)
                record = {"bench": "ctr_vs_tf", "case": "pair", "pair": pair, "topology": f"{num_ps}x{workers}",
                          "flags": args.flags, "paramserver_examples_per_s": ours,
                          "tensorflow_examples_per_s": theirs, "ratio": round(ours / theirs, 3)}
                results[record["topology"]].append(record)
                print(json.dumps(record), flush=True)
    for topology, pairs in results.items():
        print(json.dumps(summary(topology, args.flags, pairs)), flush=True)


if __name__ == "__main__":
    main()
