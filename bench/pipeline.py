"""The plain loop of examples/ctr.py (pipelined by the library) against the hand-pipelined loop.

For each round, mode (exact, overlap) and topology, runs examples/ctr.py and
bench/ctr_hand_pipelined.py back to back on the same data, and prints one JSON line: the mean
examples/s of each and, per case, the ratio plain / hand (median over the rounds; target >= 0.9).

    python bench/pipeline.py [--rounds 3] [--rows 100000] [--topologies 1x1,2x2]
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedding import run_ctr, write_ctr_data

HAND = str(Path(__file__).resolve().parent / "ctr_hand_pipelined.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=100_000, help="training lines")
    parser.add_argument("--topologies", default="1x1,2x2", help="PSxWORKERS, comma separated")
    args = parser.parse_args()
    cases = [(mode, topology) for mode in ("exact", "overlap") for topology in args.topologies.split(",")]
    rates: dict[str, dict[str, list[float]]] = {f"{m} {t}": {"plain": [], "hand": []} for m, t in cases}
    with tempfile.TemporaryDirectory() as tmp:
        train, test = write_ctr_data(tmp, args.rows)
        for _ in range(args.rounds):
            for mode, topology in cases:
                num_ps, workers = (int(n) for n in topology.split("x"))
                flags = ["--overlap"] if mode == "overlap" else []
                for loop, script in (("plain", ""), ("hand", HAND)):
                    rate = run_ctr(num_ps, workers, flags, train, test, script)["examples_per_s"]
                    rates[f"{mode} {topology}"][loop].append(rate)
    record = {"bench": "pipeline", "rounds": args.rounds, "rows": args.rows}
    for case, loops in rates.items():
        ratios = [p / h for p, h in zip(loops["plain"], loops["hand"])]
        record[case] = {"plain_examples_per_s": round(statistics.mean(loops["plain"]), 1),
                        "hand_examples_per_s": round(statistics.mean(loops["hand"]), 1),
                        "ratio_median": round(statistics.median(ratios), 3)}
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
