"""A plain `python train.py` (in-process shards, no launcher) on a busy machine: how long 40 steps
of a small CTR model take while one busy process keeps a core (docs/performance.md, "Torch threads
of a worker").

Each case is a fresh Python process (libgomp reads its wait policy when torch loads), timed over
40 steps after one warm-up step; the figure is the median of `--repeats` processes. Cases: the
script imports paramserver before torch, or torch first, and with `--before-src` the same two on
another source tree (the code before a change, as `PYTHONPATH`); `user_passive` sets
OMP_WAIT_POLICY=PASSIVE itself (the reference). Prints one JSON line.

    python bench/omp_wait.py [--repeats 3] [--busy 1] [--before-src /tmp/old/src]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from contend import busy_processes  # a sibling module

_SRC = str(Path(__file__).resolve().parent.parent / "src")
_TIMEOUT_S = 300.0
_WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")

# the script a user would write; IMPORTS is replaced by the case's import order
_SCRIPT = """
IMPORTS
import time
import torch.nn as nn
ctx = ps.init()
torch.manual_seed(0)
emb = ps.nn.HashEmbedding(16, std=0.01, name="e")
mlp = nn.Sequential(nn.Linear(13 + 26 * 16, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 1))
opt = ps.optim.Adam([*emb.parameters(), *mlp.parameters()], lr=1e-3)
g = torch.Generator().manual_seed(1)

def step():
    dense = torch.randn(512, 13, generator=g)
    sparse = torch.randint(0, 100_000, (512, 26), generator=g)
    y = torch.randint(0, 2, (512,), generator=g).float()
    logit = mlp(torch.cat([dense, emb(sparse).flatten(1)], 1)).squeeze(1)
    loss = nn.functional.binary_cross_entropy_with_logits(logit, y)
    opt.zero_grad()
    loss.backward()
    opt.step()

step()
start = time.perf_counter()
for _ in range(40):
    step()
print(time.perf_counter() - start, torch.get_num_threads(), flush=True)
"""
_ORDERS = {
    "paramserver_first": "import paramserver as ps\nimport torch",
    "torch_first": "import torch\nimport paramserver as ps",
}


def run_once(src: str, order: str, extra_env: dict[str, str]) -> tuple[float, int]:
    """Seconds for 40 steps and torch's thread count, in a fresh process on `src`."""
    env = {k: v for k, v in os.environ.items() if k not in _WAIT_ENV}
    env.update(PYTHONPATH=src, **extra_env)
    script = _SCRIPT.replace("IMPORTS", _ORDERS[order])
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"case {order} on {src} failed: {out.stderr[-2000:]}")
    seconds, threads = out.stdout.split()[-2:]
    return float(seconds), int(threads)


def case(src: str, order: str, repeats: int, extra_env: dict[str, str] | None = None) -> dict:
    runs = [run_once(src, order, extra_env or {}) for _ in range(repeats)]
    times = [t for t, _ in runs]
    return {
        "s_40_steps": round(statistics.median(times), 3),
        "runs_s": [round(t, 3) for t in times],
        "torch_threads": runs[-1][1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--busy", type=int, default=1, help="busy processes while the cases run")
    parser.add_argument("--before-src", help="another source tree to measure the same cases on (before)")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    result: dict = {"bench": "omp_wait", "steps": 40, "busy_processes": args.busy, "cores": cores}
    with busy_processes(args.busy):
        trees = {"after": _SRC, **({"before": args.before_src} if args.before_src else {})}
        for name, src in trees.items():
            for order in _ORDERS:
                result[f"{name}_{order}"] = case(src, order, args.repeats)
        result["user_passive_torch_first"] = case(
            args.before_src or _SRC, "torch_first", args.repeats, {"OMP_WAIT_POLICY": "PASSIVE"}
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
