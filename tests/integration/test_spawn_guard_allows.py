"""The spawn guard's other side (tests/spawn_guard.py): a test marked `cluster` may start a process."""

import subprocess
import sys

import pytest


@pytest.mark.cluster
def test_a_cluster_test_may_start_processes():
    assert subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True, text=True,
                          check=True).stdout == "7\n"
