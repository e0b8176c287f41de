"""What mutual TLS costs: the seed MLP (bench/dense_worker.py) on 1 PS + 2 workers, plaintext vs mutual
TLS, both over TCP (the tensor stream without shared memory), measured back to back in one run.

Rounds alternate (plaintext, TLS, plaintext, TLS, ...) so that a change in the machine's load
touches both. Prints one JSON line: examples/s summed over the workers for each, and the ratio.

    python bench/tls.py [--seconds 10] [--rounds 2]
"""

import argparse
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

from paramserver.base.config import Options
from paramserver.launch.local.supervisor import LocalCluster, default_torch_threads
from paramserver.security.certs import write_certs

WORKER = str(Path(__file__).with_name("dense_worker.py"))
NUM_PS, NUM_WORKERS = 1, 2


def examples_per_s(seconds: float, batch_size: int, certs: Path | None) -> float:
    options = Options(use_stream=True, shared_memory=False,
                      torch_threads=default_torch_threads(NUM_WORKERS))
    cluster = LocalCluster(NUM_PS, NUM_WORKERS, WORKER, ["--seconds", str(seconds), "--batch-size", str(batch_size)],
                           options, out=io.StringIO(), progress_every=0, log_level="WARNING", certs=certs)
    code = cluster.run()
    if code != 0:
        raise SystemExit(f"{'TLS' if certs else 'plaintext'} run failed with code {code}:\n"
                         f"{cluster._lines.out.getvalue()[-3000:]}")
    summary = cluster.summary()
    return sum(summary[f"worker{i}_examples_per_s"] for i in range(NUM_WORKERS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds per run, after warm-up")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="plaintext + TLS pairs (default 2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        certs = Path(directory) / "certs"
        write_certs(certs, [f"ps-{i}" for i in range(NUM_PS)] + [f"worker-{i}" for i in range(NUM_WORKERS)])
        plain, tls = [], []
        for _ in range(args.rounds):
            plain.append(examples_per_s(args.seconds, args.batch_size, None))
            tls.append(examples_per_s(args.seconds, args.batch_size, certs))
    result = {"bench": "tls", "ps": NUM_PS, "workers": NUM_WORKERS, "transport": "tcp (stream, no shared memory)",
              "batch_size": args.batch_size, "seconds": args.seconds,
              "plaintext_examples_per_s": round(statistics.mean(plain), 1),
              "tls_examples_per_s": round(statistics.mean(tls), 1),
              "tls_over_plaintext": round(statistics.mean(tls) / statistics.mean(plain), 3),
              "rounds": [{"plaintext": round(p, 1), "tls": round(t, 1)} for p, t in zip(plain, tls)]}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
