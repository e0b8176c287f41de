"""The Criteo reader's speed, this tree's against a base commit's, back to back in one run.

Prints one JSON line: lines per second of each side and the ratio new/old (median over
alternated rounds; this machine drifts tens of percent between minutes, so only same-run ratios
mean much), for:
- c_end_to_end: `array_batches(file, batch)`, reading the file and parsing with the C parser;
- c_kernel: `ps_parse_criteo` alone, on the same joined batches (the C change by itself);
- numpy_end_to_end: as c_end_to_end with the numpy parser (kernels off), on fewer lines.

Both sides are built here the same way: each side's `_kernels.c` compiled into a temp dir
with the same flags, and each side's `criteo.py` loaded as a module of its own with that
library as its kernels. The base's files come from git (`--base`, default the commit before
the reader refused bad lines). The synthetic file is examples/ctr_data.py's (seeded Zipf hex
ids, heavy-tailed counts, ~5% missing), and both sides must parse it to the same arrays.
Seconds are this process's CPU seconds (time.process_time: the parse is one thread, and other
processes taking the cores then do not count); `--wall` measures wall-clock seconds instead.

    python bench/criteo_parse.py [--rows 200000] [--rounds 7] [--base COMMIT]
"""

import argparse
import ctypes
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BASE = "fc777628e7bba72a70e36c08946771fbb7d8f003"  # the reader before bad lines were refused
CRITEO_PY = "src/paramserver/data/criteo.py"
KERNELS_C = {BASE: "src/paramserver/server/_kernels.c", None: "src/paramserver/base/_kernels.c"}
# the base commit's criteo.py imports from where those modules lived then
OLD_IMPORTS = {"from ..errors ": "from ..base.errors ", "from ..server import kernels": "from ..base import kernels",
               "from ..server.hash_index ": "from ..base.hashing ", "from .loader ": "from paramserver.data.loader "}
CFLAGS = ["-O3", "-fno-math-errno", "-fwrapv", "-fPIC", "-shared"]  # setup.py's, as setuptools adds them


def source(rev: str | None, path: str) -> str:
    """A file of this tree (rev None) or of a commit."""
    if rev is None:
        return (ROOT / path).read_text()
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def side(rev: str | None, name: str, tmp: Path) -> types.ModuleType:
    """criteo.py of `rev` as module `name`, its kernels the library built from `rev`'s _kernels.c."""
    c_file = tmp / f"{name}.c"
    c_file.write_text(source(rev, KERNELS_C[rev]))
    lib_file = tmp / f"{name}.so"
    subprocess.run(["cc", *CFLAGS, str(c_file), "-o", str(lib_file), "-lm"], check=True)
    lib = ctypes.CDLL(str(lib_file))
    lib.ps_parse_criteo.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_void_p]
    lib.ps_parse_criteo.restype = ctypes.c_int64
    spec = importlib.util.spec_from_loader(f"paramserver.data.{name}", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "paramserver.data"
    text = source(rev, CRITEO_PY)
    for old, new in (OLD_IMPORTS.items() if rev else ()):
        text = text.replace(old, new)
    exec(compile(text, f"{rev or 'tree'}:{CRITEO_PY}", "exec"), module.__dict__)
    module.kernels = types.SimpleNamespace(KERNELS=lib, ptr=lambda a: None if a is None else a.ctypes.data)
    module.lib = lib
    return module


def write_data(path: Path, rows: int, seed: int) -> None:
    spec = importlib.util.spec_from_file_location("ctr_data", ROOT / "examples" / "ctr_data.py")
    ctr_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ctr_data)
    ctr_data.write(str(path), *ctr_data.generate(rows, 2_000_000, seed), 0.05, seed)


def end_to_end(module, path: Path, batch: int, clock) -> float:
    started = clock()
    lines = sum(len(labels) for _, _, labels in module.array_batches(str(path), batch))
    return lines / (clock() - started)


def kernel(module, joined: list[tuple[bytes, int]], clock) -> float:
    """lines/s of the C parser alone over pre-joined batches (output arrays made once)."""
    n = max(count for _, count in joined)
    labels, dense, sparse = np.empty(n, np.float32), np.empty((n, 13), np.float32), np.empty((n, 26), np.int64)
    args = labels.ctypes.data, dense.ctypes.data, sparse.ctypes.data
    started = clock()
    for data, count in joined:
        if module.lib.ps_parse_criteo(data, len(data), count, *args) != count:
            raise RuntimeError("the C parser refused the synthetic data")
    return sum(count for _, count in joined) / (clock() - started)


def same_arrays(old, new, path: Path, batch: int) -> bool:
    pairs = zip(old.array_batches(str(path), batch), new.array_batches(str(path), batch), strict=True)
    return all(np.array_equal(a, b) for got_old, got_new in pairs for a, b in zip(got_old, got_new))


def alternated(rounds: int, measure) -> dict:
    """Each side `rounds` times, alternating which goes first; medians and the ratio of medians."""
    got = {"old": [], "new": []}
    for r in range(rounds):
        for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
            got[which].append(measure(which))
    old, new = statistics.median(got["old"]), statistics.median(got["new"])
    return {"old_lines_per_s": round(old), "new_lines_per_s": round(new), "ratio_new_old": round(new / old, 3),
            "new_range": [round(min(got["new"])), round(max(got["new"]))],
            "old_range": [round(min(got["old"])), round(max(got["old"]))]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--numpy-rows", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--base", default=BASE, help="commit of the old reader")
    parser.add_argument("--wall", action="store_true", help="wall-clock seconds, not CPU seconds")
    args = parser.parse_args()
    clock = time.perf_counter if args.wall else time.process_time
    sys.path.insert(0, str(ROOT / "src"))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sides = {"old": side(args.base, "criteo_old", tmp), "new": side(None, "criteo_new", tmp)}
        path, small = tmp / "train.tsv", tmp / "small.tsv"
        write_data(path, args.rows, args.seed)
        small.write_bytes(b"".join(path.read_bytes().splitlines(keepends=True)[:args.numpy_rows]))
        identical = same_arrays(sides["old"], sides["new"], path, args.batch)
        lines = path.read_bytes().splitlines(keepends=True)
        joined = [(b"".join(lines[i:i + args.batch]), len(lines[i:i + args.batch]))
                  for i in range(0, len(lines), args.batch)]
        result = {"bench": "criteo_parse", "base": args.base, "rows": args.rows, "batch": args.batch,
                  "rounds": args.rounds, "seconds": "wall" if args.wall else "cpu", "identical_arrays": identical,
                  "c_end_to_end": alternated(args.rounds, lambda w: end_to_end(sides[w], path, args.batch, clock)),
                  "c_kernel": alternated(args.rounds, lambda w: kernel(sides[w], joined, clock))}
        for module in sides.values():
            module.kernels.KERNELS = None
        result["numpy_rows"] = args.numpy_rows
        result["numpy_end_to_end"] = alternated(args.rounds, lambda w: end_to_end(sides[w], small, args.batch, clock))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
