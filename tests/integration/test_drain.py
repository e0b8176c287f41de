"""A drain always ends within `drain_grace_s`, whatever health clients do: 200 Watch streams that
cancel as soon as they read NOT_SERVING (which once deadlocked grpc_health's graceful shutdown: the
PS never logged "draining" and never exited) are cancelled, not awaited."""

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytestmark = pytest.mark.cluster  # a real PS process

STREAMS = 200
GRACE_S = 3.0


async def watch_until_not_serving(address: str, watching: threading.Event, told: list) -> None:
    """STREAMS Watch streams, each on its own connection; each cancels its call when it reads NOT_SERVING."""
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(STREAMS)]
    try:
        serving = asyncio.Semaphore(0)

        async def one(channel) -> None:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                async for reply in call:
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        serving.release()
                    elif reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                        told.append(reply.status)
                        call.cancel()
                        return
            except grpc.aio.AioRpcError:  # the PS cancelled it, or went away
                return

        tasks = [asyncio.ensure_future(one(channel)) for channel in channels]
        for _ in range(STREAMS):
            await asyncio.wait_for(serving.acquire(), 60)
        watching.set()
        await asyncio.wait(tasks, timeout=60)
    finally:
        for channel in channels:
            await channel.close()


def test_a_drain_with_200_watch_streams_that_cancel_on_not_serving_ends_within_the_grace(procs):
    proc = procs.start([sys.executable, "-m", "paramserver", "node", "--role", "ps", "--index", "0",
                        "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=procs.env(PARAMSERVER_OPTIONS=json.dumps({"drain_grace_s": GRACE_S})))
    line = proc.stdout.readline()
    assert line.startswith("PARAMSERVER_READY"), line
    address = line.split()[-1]
    watching, told = threading.Event(), []
    watcher = threading.Thread(target=lambda: asyncio.run(watch_until_not_serving(address, watching, told)),
                               name="health-watchers", daemon=True)
    watcher.start()
    assert watching.wait(60), "the Watch streams did not all read SERVING"
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(GRACE_S + 5)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the PS did not exit within {GRACE_S + 5:.0f}s of SIGTERM; stderr:\n{proc.stderr.read()[-3000:]}")
    took = time.monotonic() - started
    log = proc.stderr.read()
    assert code == 0 and "draining" in log, log[-3000:]
    assert took < GRACE_S + 2, f"drained in {took:.1f}s"
    watcher.join(30)
    assert not watcher.is_alive()
    assert procs.leftovers() == []
