"""examples/ctr.py against TensorFlow's ParameterServerStrategy, alternated run by run.

This machine's speed drifts by tens of percent within minutes, so a ratio is only meaningful
between runs made back to back. For each of `--pairs` rounds and each topology, this runs
examples/ctr.py (with `--flags`) on a local cluster and then bench/tf_reference.py with the
TensorFlow interpreter given by `--tf-python`, and prints one JSON line per pair (both
examples/s and their ratio), then one summary line per topology (median and range of the ratios,
and the ratio of the means).

    python bench/ctr_vs_tf.py --tf-python /tmp/tfvenv/bin/python [--pairs 5] [--flags=--overlap]
        [--topologies 1x1,2x2] [--rows 200000] [--contend N]

(see bench/tf_reference.py for making that TensorFlow virtual environment; without `--tf-python`
only paramserver is measured). `--contend N` measures every pair a second time with N busy
processes running (bench/contend.py) and reports both in the pair's line (`contended_*`, and
`*_contended_ratio`: contended / quiet), with the load averages at the end of each run. A run
that fails prints its pair's line with `error` (the end of that run's output) and the bench goes
on; the summaries count the pairs that ran.
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
from contend import busy_processes, load  # a sibling module
from cpu_share import CpuShare  # a sibling module
from embedding import run_ctr, write_ctr_data  # a sibling benchmark script

HERE = Path(__file__).resolve().parent


def tensorflow_rate(tf_python: str, num_ps: int, workers: int, train: str, test: str) -> float:
    out = subprocess.run([tf_python, str(HERE / "tf_reference.py"), "--train", train, "--test", test,
                          "--topologies", f"{num_ps}x{workers}"], check=True, capture_output=True, text=True).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["examples_per_s"]


def summary(topology: str, flags: str, pairs: list[dict]) -> dict:
    record = {"bench": "ctr_vs_tf", "case": "summary", "topology": topology, "flags": flags, "pairs": len(pairs)}
    for prefix in ("", "contended_"):
        if f"{prefix}ratio" not in pairs[0]:
            continue
        ratios = [p[f"{prefix}ratio"] for p in pairs]
        ours = statistics.mean(p[f"{prefix}paramserver_examples_per_s"] for p in pairs)
        theirs = statistics.mean(p[f"{prefix}tensorflow_examples_per_s"] for p in pairs)
        record.update({f"{prefix}ratio_median": round(statistics.median(ratios), 3),
                       f"{prefix}ratio_min": min(ratios), f"{prefix}ratio_max": max(ratios),
                       f"{prefix}ratio_of_means": round(ours / theirs, 3)})
    if "paramserver_contended_ratio" in pairs[0]:
        record["paramserver_contended_ratio_min"] = min(p["paramserver_contended_ratio"] for p in pairs)
    return record


def measure(tf_python: str | None, num_ps: int, workers: int, flags: list[str], train: str, test: str,
            prefix: str, busy: list[int]) -> dict:
    """One run of ours and one of TensorFlow's (when given), back to back; their figures under `prefix`
    (`busy`: the PIDs of the busy processes, left out of the cores each process used)."""
    with CpuShare(exclude=busy) as ours_cores:
        ours = run_ctr(num_ps, workers, flags, train, test)
    record = {f"{prefix}paramserver_examples_per_s": ours["examples_per_s"], f"{prefix}paramserver_load": load(),
              f"{prefix}paramserver_torch_threads": ours["torch_threads"],
              f"{prefix}paramserver_cores": ours_cores.cores()}
    if tf_python:
        with CpuShare(exclude=busy) as theirs_cores:
            theirs = tensorflow_rate(tf_python, num_ps, workers, train, test)
        record.update({f"{prefix}tensorflow_examples_per_s": theirs, f"{prefix}tensorflow_load": load(),
                       f"{prefix}tensorflow_cores": theirs_cores.cores(),
                       f"{prefix}ratio": round(record[f"{prefix}paramserver_examples_per_s"] / theirs, 3)})
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tf-python", help="python of a virtual environment with TensorFlow 2.21 (default: "
                                              "paramserver alone)")
    parser.add_argument("--pairs", type=int, default=5, help="alternated pairs of runs per topology")
    parser.add_argument("--flags", default="", help="examples/ctr.py flags, e.g. --flags=--overlap")
    parser.add_argument("--topologies", default="1x1,2x2", help="PSxWORKERS, comma separated")
    parser.add_argument("--rows", type=int, default=200_000, help="training lines")
    parser.add_argument("--contend", type=int, default=0,
                        help="also run each pair under N busy processes and report both (default 0: quiet only)")
    args = parser.parse_args()
    topologies = [tuple(int(n) for n in t.split("x")) for t in args.topologies.split(",")]
    flags = shlex.split(args.flags)
    results: dict[str, list[dict]] = {f"{p}x{w}": [] for p, w in topologies}
    with tempfile.TemporaryDirectory() as tmp:
        train, test = write_ctr_data(tmp, args.rows)
        for pair in range(args.pairs):
            for num_ps, workers in topologies:
                record = {"bench": "ctr_vs_tf", "case": "pair", "pair": pair, "topology": f"{num_ps}x{workers}",
                          "flags": args.flags}
                try:
                    record.update(pair_figures(args, num_ps, workers, flags, train, test))
                    results[record["topology"]].append(record)
                except (SystemExit, subprocess.CalledProcessError) as exc:  # a failed run: its line says why
                    record["error"] = failure(exc)
                print(json.dumps(record), flush=True)
    for topology, pairs in results.items():
        if pairs:
            print(json.dumps(summary(topology, args.flags, pairs)), flush=True)


def pair_figures(args: argparse.Namespace, num_ps: int, workers: int, flags: list[str], train: str,
                 test: str) -> dict:
    """One pair's figures: quiet, and with `--contend` busy processes too."""
    record = measure(args.tf_python, num_ps, workers, flags, train, test, "", [])
    if args.contend:
        record["contend"] = args.contend
        with busy_processes(args.contend) as busy:
            record.update(measure(args.tf_python, num_ps, workers, flags, train, test, "contended_", busy))
        for side in ("paramserver", "tensorflow"):
            if f"{side}_examples_per_s" in record:
                record[f"{side}_contended_ratio"] = round(
                    record[f"contended_{side}_examples_per_s"] / record[f"{side}_examples_per_s"], 3)
    return record


def failure(exc: BaseException) -> str:
    """The end of what a failed run printed (a cluster's output, or TensorFlow's stderr)."""
    if isinstance(exc, subprocess.CalledProcessError):
        return f"{exc.cmd[0]} exited with {exc.returncode}: {(exc.stderr or '')[-3000:]}"
    return str(exc.code)[-3000:]


if __name__ == "__main__":
    main()
