"""Recovery without a launcher: kill -9 a PS (then the chief) of a cluster of `paramserver node`
processes, each under a restart loop as Kubernetes would run it, and measure until training goes on.

1 PS holding a 1M-row table (bench/recovery_worker.py) and 2 workers (worker 0 the chief),
checkpoints every 20 steps. After the first checkpoint the PS is killed; the restart loop starts it
again at once (Kubernetes would wait 10 s first: CrashLoopBackOff, not counted here), the cluster
rolls back by itself, and the time to the first step trained again is read from the chief's
"STEP <n> <time>" lines. Then the same for the chief. One JSON line.

    python bench/recovery_in_cluster.py [--rows 1000000]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from recovery import wait_for  # bench/ is on the path when run as a script

from paramserver.launch.local.ports import free_port

ROOT = Path(__file__).resolve().parents[1]


class Loop:
    """One node, started again whenever it exits non-zero; its lines, with a lock."""

    def __init__(self, name: str, argv: list[str], env: dict, lines: list, lock: threading.Lock) -> None:
        self.name, self.argv, self.env, self.lines, self.lock = name, argv, env, lines, lock
        self.proc: subprocess.Popen | None = None
        self.stopping = False
        threading.Thread(target=self.run, name=f"loop-{name}", daemon=True).start()

    def run(self) -> None:
        while not self.stopping:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         text=True, start_new_session=True)
            for line in self.proc.stdout:
                with self.lock:
                    self.lines.append(f"[{self.name}] {line}")
            if self.proc.wait() == 0:
                return

    def stop(self) -> None:
        self.stopping = True
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


def kill_to_first_step(loops: dict, lines: list, victim: str, after: int) -> tuple[float, int]:
    """Seconds from killing `victim` to the chief's first step after the roll-back, and the line reached."""
    killed_at = time.time()
    loops[victim].proc.kill()
    restarted = wait_for(lines, r"\[worker0\] .*restarted from the latest checkpoint|\[worker0\] .*running ", after)
    step = wait_for(lines, r"\[worker0\] STEP \d+ ", restarted)
    return round(float(lines[step].split()[-1]) - killed_at, 2), step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args()
    cluster = {"ps": [f"127.0.0.1:{free_port()}"], "worker": [f"127.0.0.1:{free_port()}" for _ in range(2)]}
    lines: list[str] = []
    lock = threading.Lock()
    loops: dict[str, Loop] = {}
    with tempfile.TemporaryDirectory() as tmp:
        options = {"checkpoint_dir": tmp, "checkpoint_every": 20}
        for role, addresses in cluster.items():
            for index in range(len(addresses)):
                env = {**os.environ, "PYTHONUNBUFFERED": "1", "PARAMSERVER_OPTIONS": json.dumps(options),
                       "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})}
                script = [] if role == "ps" else [str(ROOT / "bench" / "recovery_worker.py"), "--rows", str(args.rows)]
                loops[f"{role}{index}"] = Loop(f"{role}{index}", [sys.executable, "-m", "paramserver", "node", *script],
                                               env, lines, lock)
        try:
            committed = wait_for(lines, r"ckpt-000000020: committed")
            ps_s, step = kill_to_first_step(loops, lines, "ps0", committed)
            committed = wait_for(lines, r": committed", step)
            chief_s, _ = kill_to_first_step(loops, lines, "worker0", committed)
        finally:
            for loop in loops.values():
                loop.stop()
    print(json.dumps({"bench": "recovery_in_cluster", "ps_rows": args.rows, "ps_killed_to_first_step_s": ps_s,
                      "chief_killed_to_first_step_s": chief_s}), flush=True)


if __name__ == "__main__":
    main()
