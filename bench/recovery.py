"""Recovery time: kill -9 a PS holding a 1M-row table, measure until training goes on.

Runs `paramserver run --ps 1 --workers 1` with checkpoints every 20 steps on
bench/recovery_worker.py, waits for the first checkpoint (with every row in it), kills the PS
with SIGKILL, and reads the time of the first step trained after the rollback. One JSON line:
kill-to-first-step seconds, with the launcher's restart time and the PS's restore time.

    python bench/recovery.py [--rows 1000000]
"""

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, "-m", "paramserver", "run", "--ps", "1", "--workers", "1",
                                 "--progress-every", "0", "--checkpoint-dir", tmp, "--checkpoint-every", "20",
                                 str(ROOT / "bench" / "recovery_worker.py"), "--", "--rows", str(args.rows)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        try:
            result = measure(proc, lines, args.rows)
        finally:
            proc.terminate()
            proc.wait(30)
    print(json.dumps(result), flush=True)


def wait_for(lines: list[str], pattern: str, start: int = 0, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i in range(start, len(lines)):
            if re.search(pattern, lines[i]):
                return i
        time.sleep(0.01)
    raise SystemExit(f"no {pattern!r} in {timeout}s:\n" + "".join(lines[-30:]))


def measure(proc: subprocess.Popen, lines: list[str], rows: int) -> dict:
    committed = wait_for(lines, r"ckpt-000000020: committed")
    checkpoint_s = float(re.search(r"in ([\d.]+)s", lines[committed]).group(1))
    ps_node = next(c for c in psutil.Process(proc.pid).children() if "--role ps" in " ".join(c.cmdline()))
    killed_at = time.time()
    ps_node.kill()
    restored = wait_for(lines, r"resuming from ckpt-", committed)
    restarted = wait_for(lines, r"cluster restarted in", committed)
    step = wait_for(lines, r"\] STEP \d+ ", restarted)
    first_step_at = float(lines[step].split()[-1])
    return {"bench": "recovery", "ps_rows": rows, "checkpoint_write_s": checkpoint_s,
            "ps_restore_s": float(re.search(r"in ([\d.]+)s", lines[restored]).group(1)),
            "cluster_restart_s": float(re.search(r"restarted in ([\d.]+)s", lines[restarted]).group(1)),
            "kill_to_first_step_s": round(first_step_at - killed_at, 2),
            "resumed_at_step": int(lines[step].split()[-2])}


if __name__ == "__main__":
    main()
