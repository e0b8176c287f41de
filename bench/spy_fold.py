"""Where a run's processes spent their time: py-spy's raw samples folded per process and per phase.

    pip install py-spy
    py-spy record --subprocesses --format raw -r 200 -o /tmp/ctr.txt -- \\
        paramserver run --ps 1 --workers 1 examples/ctr.py -- --train T --test V
    python bench/spy_fold.py /tmp/ctr.txt --root "main (ctr.py)" --phase "CTRModel.forward" \\
        --phase "Tensor.backward" --phase "PSOptimizer.step" --phase "Pending.wait"

For each process (busiest first) it prints one JSON line: its samples, and for each `--phase` the
share of the samples under `--root` that have that function on their stack (a phase named in a
phase is counted in both: `Pending.wait` is inside `PSOptimizer.step`). py-spy leaves out threads it
finds idle, but a thread blocked in a socket read can still be sampled: read the phases of the
training thread (`--root`), not a process's total. Functions are matched by the start of py-spy's
frame text, `name (file)`, without the line number.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict

_LINE = re.compile(r":\d+\)$")


def fold(path: str) -> dict[str, list[tuple[list[str], int]]]:
    """Stacks per process: {process frame: [(frames without line numbers, samples), ...]}."""
    stacks: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            starts = [i for i, frame in enumerate(frames) if frame.startswith("process ")]
            at = starts[-1] if starts else 0  # a child's samples sit under its parents' process frames
            stacks[frames[at][:120]].append(([_LINE.sub(")", fr) for fr in frames[at + 1:]], int(count)))
    return stacks


def phases(samples: list[tuple[list[str], int]], root: str, names: list[str]) -> dict:
    """Samples under `root`, and each phase's share of them."""
    under, hits = 0, Counter()
    for frames, count in samples:
        if not any(fr.startswith(root) for fr in frames):
            continue
        under += count
        for name in names:
            if any(fr.startswith(name) for fr in frames):
                hits[name] += count
    return {"root_samples": under,
            "shares": {name: round(hits[name] / under, 3) if under else 0.0 for name in names}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", help="py-spy record --format raw output")
    parser.add_argument("--root", default="", help="the training thread's function, e.g. 'main (ctr.py)'")
    parser.add_argument("--phase", action="append", default=[], help="a function whose share to report")
    parser.add_argument("--min-samples", type=int, default=200, help="leave out processes with fewer samples")
    args = parser.parse_args()
    for process, samples in sorted(fold(args.raw).items(), key=lambda kv: -sum(c for _, c in kv[1])):
        total = sum(count for _, count in samples)
        if total < args.min_samples:
            continue
        record = {"bench": "spy_fold", "process": process, "samples": total}
        if args.root:
            record.update(phases(samples, args.root, args.phase))
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
