"""A PS process of a run that ends its PS (`stop_ps_at_end`: Kubernetes, Slurm), with a checkpoint_dir,
serves on after its first SIGTERM for the workers' preemption checkpoint (node/ps_stop.py): until
`preempt_grace_s` passed, then it drains and exits 143; a second signal drains it at once."""

import json
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.cluster  # a real PS process

GRACE_S = 3.0


def _start_ps(procs, tmp_path):
    options = {"checkpoint_dir": str(tmp_path / "ckpt"), "stop_ps_at_end": True, "preempt_grace_s": GRACE_S}
    proc = procs.start(
        [sys.executable, "-m", "paramserver", "node", "--role", "ps", "--index", "0", "--bind", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=procs.env(PARAMSERVER_OPTIONS=json.dumps(options)),
    )
    line = proc.stdout.readline()
    assert line.startswith("PARAMSERVER_READY"), line
    return proc, line.split()[-1]


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_the_first_sigterm_serves_on_for_the_grace_then_drains(procs, tmp_path):
    proc, address = _start_ps(procs, tmp_path)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    time.sleep(GRACE_S / 4)
    assert _health(address) == health_pb2.HealthCheckResponse.SERVING  # the workers' checkpoint may come
    code = proc.wait(GRACE_S + 15)
    took = time.monotonic() - started
    log = proc.stderr.read()
    assert code == 128 + signal.SIGTERM, log[-3000:]  # stopped by a signal before the run ended it
    assert GRACE_S <= took < GRACE_S + 5, f"exited {took:.1f}s after SIGTERM"
    assert "serving on for the workers' preemption checkpoint" in log and "grace of 3s is over" in log, log[-3000:]
    assert procs.leftovers() == []


def test_a_second_sigterm_drains_at_once(procs, tmp_path):
    proc, _ = _start_ps(procs, tmp_path)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(15)
    assert code == 128 + signal.SIGTERM
    assert time.monotonic() - started < GRACE_S, "the second signal waited for the grace"
    assert procs.leftovers() == []
