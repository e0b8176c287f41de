"""A worker script for the launcher's memory accounting: it starts a child process (as a data
loader would) that holds --mb MB for a few seconds, then exits without joining the cluster."""

import argparse
import subprocess
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--mb", type=int, default=300)
args = parser.parse_args()

held = f"data = b'x' * ({args.mb} << 20); import time; time.sleep(4)"  # bytes are written: resident
subprocess.run([sys.executable, "-c", held], check=True)
