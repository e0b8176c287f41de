"""The Ray engine: a run's PS and workers as Ray actors on a Ray cluster (launch/ray/engine.py).

    import paramserver
    code = paramserver.ray.run("train.py", ["--epochs", "3"], num_ps=1, num_workers=2, address="10.0.0.1:6379",
                               resources={"ps": {"CPU": 2, "memory": 4 << 30}, "worker": {"CPU": 4, "GPU": 1}})

or `paramserver run --engine ray --address ADDR ...`. Needs the `ray` extra: pip install 'paramserver[ray]'.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from paramserver.base.config import Options
from paramserver.base.errors import ConfigError

__all__ = ["run"]


def run(
    script: str,
    args: Sequence[str] = (),
    num_ps: int = 1,
    num_workers: int = 1,
    options: Options | None = None,
    address: str | None = None,
    resources: Mapping[str, Any] | None = None,
    *,
    out: TextIO | None = None,
    progress_every: float = 2.0,
    log_level: str = "INFO",
    max_restarts: int = 3,
) -> int:
    """Run `script` (a path every Ray node can read) with `args` on `num_ps` PS and `num_workers` workers of the
    Ray cluster at `address` (HOST:PORT of its GCS; None: RAY_ADDRESS, else the cluster started on this host).
    `resources`: each node's Ray resource request ({"CPU": 2, "GPU": 1, "memory": bytes, custom...}), or one per
    role ({"ps": {...}, "worker": {...}}); default 1 CPU. Prints the nodes' prefixed output, progress lines and,
    last, the closing JSON line to `out` (default stdout); returns the exit code (0: every worker succeeded).
    A node lost is recovered from at most `max_restarts` times (a worker restarted alone; with
    `options.checkpoint_dir`, a lost PS or chief rolls the cluster back, or with recovery "partial" a PS is
    restored alone); `options.max_workers` makes the run elastic (`paramserver scale` on this host resizes it).
    See launch/ray/engine.py. Call from one thread; a process already connected to Ray (`ray.init`) stays
    connected."""
    from paramserver.launch.ray.connect import connect, import_ray
    from paramserver.launch.ray.placement import requests

    if not Path(script).is_file():
        raise ConfigError(f"training script {script} does not exist")
    wanted = requests(resources)
    options = options or Options(torch_threads=max(1, int(wanted["worker"].get("CPU", 1))))
    options.validate(num_workers)
    ray = import_ray(address)
    from paramserver.launch.ray.engine import RayCluster

    out = out or sys.stdout
    cluster = RayCluster(
        ray,
        str(Path(script).resolve()),
        list(args),
        num_ps,
        num_workers,
        options,
        wanted,
        out,
        progress_every,
        log_level,
        max_restarts,
    )
    connected = connect(ray, address)
    try:
        return cluster.run()
    finally:
        main = threading.current_thread() is threading.main_thread()
        if main:  # the closing line, however the run ended: nothing interrupts it once the nodes are gone
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        out.write(json.dumps(cluster.summary()) + "\n")
        out.flush()
        if main:
            signal.signal(signal.SIGINT, previous)
        if connected:
            ray.shutdown()
