"""Dense throughput: the seed MLP (784-1024-512-10, Adam, batch 64 per worker) on synthetic data.

Runs a real local cluster (separate PS and worker processes, gRPC on 127.0.0.1) for each
topology and prints one JSON line per topology: steady-state examples/s summed over the
workers (after a warm-up), and peak RSS per role. `--plot FILE.png` also draws them.

    python bench/dense.py [--seconds 10] [--topologies 1x1,1x2,2x2] [--plot bench/out/dense.png]
        [--contend N] [--tf-python /tmp/tfvenv/bin/python]

`--contend N` runs each case twice back to back, quiet and then with N busy processes (one
spinning Python loop each, bench/contend.py), and reports both in its line
(`contended_examples_per_s`, `contended_ratio`), with the load averages at the end of each.
`--tf-python` (the python of a virtual environment with TensorFlow, bench/tf_reference.py) runs
TensorFlow's ParameterServerStrategy on the same model and batches right after each of our runs,
quiet and contended alike (`tensorflow_examples_per_s`, `tf_ratio` = ours / TensorFlow's, and
`contended_*` of both under the same busy processes). `cores` and `tensorflow_cores`: the cores
each process used while it trained, by role (bench/cpu_share.py).
"""

import argparse
import io
import json
import subprocess
import sys
from pathlib import Path

from paramserver.base.config import Options
from paramserver.launch.local.supervisor import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from contend import busy_processes, load  # a sibling module
from cpu_share import CpuShare  # a sibling module

WORKER = str(Path(__file__).with_name("dense_worker.py"))
TF_REFERENCE = str(Path(__file__).with_name("tf_reference.py"))


def tensorflow_rate(tf_python: str, num_ps: int, num_workers: int, seconds: float, batch_size: int) -> float:
    """examples/s of TensorFlow's ParameterServerStrategy on the same case (bench/tf_reference.py --model dense)."""
    out = subprocess.run([tf_python, TF_REFERENCE, "--model", "dense", "--topologies", f"{num_ps}x{num_workers}",
                          "--seconds", str(seconds), "--batch-size", str(batch_size)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["examples_per_s"]


def run_topology(num_ps: int, num_workers: int, seconds: float, batch_size: int, overlap: bool,
                 torch_threads: int) -> dict:
    args = ["--seconds", str(seconds), "--batch-size", str(batch_size)] + (["--overlap"] if overlap else [])
    options = Options(torch_threads=torch_threads) if torch_threads else None
    cluster = LocalCluster(num_ps, num_workers, WORKER, args, options, out=io.StringIO(), progress_every=0,
                           log_level="WARNING")
    code = cluster.run()
    if code != 0:
        raise SystemExit(f"topology {num_ps} PS x {num_workers} workers failed with code {code}:\n"
                         f"{cluster._lines.out.getvalue()[-3000:]}")
    summary = cluster.summary()
    rates = [summary[f"worker{i}_examples_per_s"] for i in range(num_workers)]
    return {"bench": "dense", "ps": num_ps, "workers": num_workers, "batch_size": batch_size, "overlap": overlap,
            "torch_threads": cluster.options.torch_threads,
            "examples_per_s": round(sum(rates), 1), "per_worker_examples_per_s": [round(r, 1) for r in rates],
            "peak_rss_mb": summary["peak_rss_mb"]}


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['ps']}x{r['workers']}{' overlap' if r['overlap'] else ''}" for r in results]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, [r["examples_per_s"] for r in results])
    ax.set_ylabel("examples/s")
    ax.set_title("seed MLP, batch 64 per worker")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds per topology, after warm-up")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--topologies", default="1x1,1x2,2x2", help="comma-separated PSxWORKERS")
    parser.add_argument("--overlap", choices=["on", "off", "both"], default="both",
                        help="optimizer overlap mode(s) to measure (default both)")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch threads per worker (default: launcher's)")
    parser.add_argument("--contend", type=int, default=0,
                        help="also run each case under N busy processes and report both (default 0: quiet only)")
    parser.add_argument("--tf-python", help="python of a virtual environment with TensorFlow: measure it after "
                                              "each of our runs (default: paramserver alone)")
    parser.add_argument("--plot", help="write a PNG bar chart here (needs matplotlib)")
    args = parser.parse_args()
    results = []
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.overlap]
    for topology in args.topologies.split(","):
        num_ps, num_workers = (int(n) for n in topology.split("x"))
        for overlap in modes:
            with CpuShare() as ours_cores:
                record = run_topology(num_ps, num_workers, args.seconds, args.batch_size, overlap, args.torch_threads)
            record["load"] = load()  # at the end of the run: 1, 5 and 15 minute averages
            record["cores"] = ours_cores.cores()  # per process while it trained (bench/cpu_share.py)
            if args.tf_python:
                with CpuShare() as theirs_cores:
                    record["tensorflow_examples_per_s"] = tensorflow_rate(args.tf_python, num_ps, num_workers,
                                                                          args.seconds, args.batch_size)
                record["tensorflow_load"] = load()
                record["tensorflow_cores"] = theirs_cores.cores()
                record["tf_ratio"] = round(record["examples_per_s"] / record["tensorflow_examples_per_s"], 3)
            if args.contend:
                record["contend"] = args.contend
                with busy_processes(args.contend):
                    contended = run_topology(num_ps, num_workers, args.seconds, args.batch_size, overlap,
                                             args.torch_threads)
                    record["contended_load"] = load()
                    if args.tf_python:
                        record["contended_tensorflow_examples_per_s"] = tensorflow_rate(
                            args.tf_python, num_ps, num_workers, args.seconds, args.batch_size)
                        record["contended_tensorflow_load"] = load()
                record["contended_examples_per_s"] = contended["examples_per_s"]
                record["contended_torch_threads"] = contended["torch_threads"]
                record["contended_ratio"] = round(contended["examples_per_s"] / record["examples_per_s"], 3)
                if args.tf_python:
                    record["tensorflow_contended_ratio"] = round(
                        record["contended_tensorflow_examples_per_s"] / record["tensorflow_examples_per_s"], 3)
                    record["contended_tf_ratio"] = round(
                        contended["examples_per_s"] / record["contended_tensorflow_examples_per_s"], 3)
            results.append(record)
            print(json.dumps(results[-1]), flush=True)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    sys.exit(main())
