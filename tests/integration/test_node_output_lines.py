"""A node's stdout and stderr share one pipe under every launcher: no line may be split by another."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster  # a real process

WRITER = """
import logging, sys, threading
from paramserver.launch.node_command import whole_lines
if sys.argv[1] == "whole":
    whole_lines()
logging.basicConfig(stream=sys.stderr, format="%(message)s")
def log():
    for _ in range(5000):
        logging.getLogger("t").warning("worker 2 joined")
thread = threading.Thread(target=log)
thread.start()
for i in range(5000):
    print(f"pushed 0 {i} {i} 1.0", flush=True)
thread.join()
"""


def merged_output(mode: str) -> list[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # as the launchers set it
    done = subprocess.run(
        [sys.executable, "-c", WRITER, mode],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.splitlines()


def test_a_print_and_a_log_line_of_another_thread_never_share_a_line():
    """Without `whole_lines`, about one line in a hundred splits here (PYTHONUNBUFFERED writes print's
    newline apart)."""
    lines = merged_output("whole")
    assert lines.count("worker 2 joined") == 5000
    assert sorted(line for line in lines if line.startswith("pushed")) == sorted(
        f"pushed 0 {i} {i} 1.0" for i in range(5000)
    )
    assert len(lines) == 10000
