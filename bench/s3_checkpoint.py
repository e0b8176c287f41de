"""Checkpoint write time: S3 (a moto server on this host) against a local directory, back to back.

Runs the same job twice, `paramserver run --ps 2 --workers 1` on bench/recovery_worker.py (a
ROWS-row dim-16 Adagrad table and a small head) with a checkpoint every 20 steps, first to a
local temporary directory, then to ``s3://bench/run`` on a moto server started for it, and reads
the chief's "committed (N bytes) in S s" lines. One JSON line: bytes per checkpoint and the
seconds of each checkpoint, local and S3. moto runs in memory on the same host: the figure is
the cost of the S3 protocol path (s3fs, HTTP, SigV4, MD5/SHA), not of a network.

    python bench/s3_checkpoint.py [--rows 200000]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' S3 server (moto behind werkzeug on port 0)

from tests.integration.s3_server import S3Server  # noqa: E402

COMMITTED = re.compile(r"(ckpt-\d+): committed \((\d+) bytes\) in ([\d.]+)s")


def checkpoints(directory: str, rows: int, env: dict[str, str]) -> list[tuple[str, int, float]]:
    """(name, bytes, seconds) of each checkpoint one run wrote to `directory`."""
    done = subprocess.run([sys.executable, "-m", "paramserver", "run", "--ps", "2", "--workers", "1",
                           "--progress-every", "0", "--checkpoint-dir", directory, "--checkpoint-every", "20",
                           str(ROOT / "bench" / "recovery_worker.py"), "--", "--rows", str(rows), "--steps", "60"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"the run to {directory} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    found = [(m.group(1), int(m.group(2)), float(m.group(3))) for m in COMMITTED.finditer(done.stdout)]
    if not found:
        raise SystemExit(f"no checkpoint committed to {directory}:\n{done.stdout[-3000:]}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        local = checkpoints(tmp, args.rows, {})
    server = S3Server()
    try:
        import s3fs

        os.environ.update(server.env())
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("bench")
        remote = checkpoints("s3://bench/run", args.rows, server.env())
    finally:
        server.stop()
    print(json.dumps({"rows": args.rows, "shards": 2, "bytes": local[-1][1],
                      "local_s": [seconds for _, _, seconds in local],
                      "s3_moto_s": [seconds for _, _, seconds in remote],
                      "checkpoints": [name for name, _, _ in local]}), flush=True)


if __name__ == "__main__":
    main()
