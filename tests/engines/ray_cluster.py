"""A real Ray cluster for the engine tests: a head and two worker nodes, every one on 127.0.0.1 (each its own
raylet and process tree), started in this process with ray.cluster_utils.Cluster and shut down at the end.

Ray must be told before it is imported that a cluster on loopback is meant (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0):
otherwise it replaces 127.0.0.1 by the machine's outside address. RAY_TMPDIR is short (AF_UNIX socket paths
live below it) and per session. Health checks are fast, so that a lost node is seen in about a second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest

RAY_VERSION = "2.60.0"
NODE = {"node_ip_address": "127.0.0.1", "num_cpus": 2, "object_store_memory": 80 << 20}
WORKER_NODE = {**NODE, "resources": {"spare": 1}}  # a node that may be lost (not the head, the driver's)
FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}


@dataclass
class RayLab:
    """The running cluster: its GCS `address`, the Cluster object (`cluster.worker_nodes`), its temp dir."""

    address: str
    cluster: Any
    tmp: str


def import_ray():
    """`ray`, installed into this venv if it is not (the `ray` extra); pytest.skip if it cannot be."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before the import: see the module docstring
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", f"ray=={RAY_VERSION}"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            pytest.skip(f"ray is not installed and pip could not install ray=={RAY_VERSION}: {done.stderr[-500:]}")
        import ray
    return ray


def start() -> RayLab:
    ray = import_ray()
    from ray.cluster_utils import Cluster

    tmp = tempfile.mkdtemp(prefix="rp", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp
    cluster = Cluster(
        initialize_head=True, head_node_args={**NODE, "include_dashboard": False, "_system_config": FAST_HEALTH}
    )
    try:
        for _ in range(2):  # one at a time: two nodes joining at once can time out on a small machine
            cluster.add_node(**WORKER_NODE)
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    assert ray is not None
    return RayLab(cluster.address, cluster, tmp)


def stop(lab: RayLab) -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
    lab.cluster.shutdown()
    shutil.rmtree(lab.tmp, ignore_errors=True)
