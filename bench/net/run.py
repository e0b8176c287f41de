"""Training throughput across an emulated network: per link rate, model and gradient codec, one JSON line.

    sudo .venv/bin/python bench/net/run.py --rates 1,10,25 --models mlp,ctr [--ps 1] [--workers 1] [--seconds 10]
        [--codecs none,auto,bf16,bf16+pull,int8,topk:0.01,fp16]

PS hosts (one PS each) and worker hosts as network namespaces on a bridge (bench/net/testbed.py), every
link shaped with tc's token bucket to the rate (`none`: unshaped), the PS hosts pinned to the first CPU and
the worker hosts to the others. Per rate it first measures the link (bench/net/link_rate.py, worker0 to PS 0),
then trains each model with each codec (bench/net/cluster.py; `bf16+pull`: bf16 pushes and values pulled
as bfloat16, `auto`: what compression auto chooses, said in `auto_chose`; `@grpc`: gRPC instead of the tensor
stream; `@msg=N`: messages of at most N bytes: bench/net/cluster.py's case_options). Each line: the model, the codec,
the set and measured link rates, examples/s (summed over the workers) and the bytes a worker pushed per step.
Links have no added delay: this kernel has no netem. Needs root; everything it made is removed on exit,
Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import run_case  # sibling modules: bench/ is no package
from link_rate import measure
from testbed import Network, NetworkError

log = logging.getLogger("bench.net.run")

HERE = Path(__file__).resolve().parent
MODELS = ("mlp", "ctr")
CODECS = "none,auto,bf16,bf16+pull,int8,topk:0.01,fp16"
CTR_ROWS, CTR_VOCAB = 100_000, 200_000  # synthetic click logs (examples/ctr_data.py), as bench/compression.py


def ctr_lines(folder: Path) -> Path:
    """The CTR model's training lines, written once per run (outside the namespaces: they share the disk)."""
    path = folder / "ctr_train.tsv"
    subprocess.run(
        [
            sys.executable,
            str(HERE.parents[1] / "examples" / "ctr_data.py"),
            "--rows",
            str(CTR_ROWS),
            "--vocab",
            str(CTR_VOCAB),
            "--seed",
            "1",
            "--out",
            str(path),
        ],
        check=True,
        timeout=300,
    )
    return path


def worker_script(model: str, folder: Path, seconds: float) -> list[str]:
    if model == "mlp":
        return [str(HERE / "mlp_worker.py"), "--seconds", str(seconds)]
    train = ["--train", str(ctr_lines(folder)), "--table-rows", str(CTR_ROWS * 4)]
    return [str(HERE / "ctr_worker.py"), *train, "--seconds", str(seconds)]


def rate(text: str) -> float | None:
    return None if text == "none" else float(text)


def place_hosts(net: Network, num_ps: int, workers: int) -> tuple:
    """The PS hosts on the first CPU this process may use, the worker hosts on the others (all on the one
    CPU when there is only one)."""
    cpus = sorted(os.sched_getaffinity(0))
    rest = ",".join(str(cpu) for cpu in cpus[1:]) or str(cpus[0])
    ps = [net.add_host(f"ps{i}", str(cpus[0])) for i in range(num_ps)]
    return ps, [net.add_host(f"worker{i}", rest) for i in range(workers)]


def stop_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so that `with Network()` removes what it made."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1,10,25", help="Gbit/s per link, comma-separated; `none`: unshaped")
    parser.add_argument("--models", default="mlp,ctr", help="comma-separated: mlp (the seed MLP), ctr")
    parser.add_argument("--codecs", default=CODECS, help=f"--compression values, comma-separated (default {CODECS})")
    parser.add_argument("--ps", type=int, default=1, help="PS hosts (each its own namespace, one PS each)")
    parser.add_argument("--workers", type=int, default=1, help="worker hosts (each its own namespace)")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds per case, after a warm-up")
    parser.add_argument("--check-seconds", type=float, default=3.0, help="seconds of the link rate check")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop_on_sigterm()
    models = args.models.split(",")
    unknown = set(models) - set(MODELS)
    if unknown:
        parser.error(f"unknown models {sorted(unknown)}: choose among {', '.join(MODELS)}")
    try:
        with Network() as net, tempfile.TemporaryDirectory(prefix="psnet-run-") as folder:
            scripts = {model: worker_script(model, Path(folder), args.seconds) for model in models}
            ps, workers = place_hosts(net, args.ps, args.workers)
            for text in args.rates.split(","):
                net.shape(rate(text))
                measured = measure(net, workers[0], ps[0], args.check_seconds)
                log.info("link %s Gbit/s: measured %.2f Gbit/s", text, measured)
                case = {
                    "bench": "net",
                    "ps": args.ps,
                    "workers": args.workers,
                    "rate_gbit": rate(text),
                    "measured_gbit_s": measured,
                    "date": time.strftime("%Y-%m-%d %H:%M"),
                }
                for model in models:
                    for codec in args.codecs.split(","):
                        figures = run_case(net, ps, workers, scripts[model], codec, args.seconds, Path(folder))
                        print(json.dumps({**case, "model": model, "codec": codec, **figures}), flush=True)
    except NetworkError as error:
        print(f"bench/net/run.py: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupted:
        print(f"bench/net/run.py: stopped ({interrupted or 'Ctrl-C'}); the testbed is removed", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
