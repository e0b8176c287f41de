"""A drain always ends within `drain_grace_s`, whatever health clients do: 200 Watch streams that
cancel as soon as they read NOT_SERVING (which once deadlocked grpc_health's graceful shutdown: the
PS never logged "draining" and never exited) are cancelled, not awaited.

And a drain lets a request in flight on the tensor stream finish and reply (a RegisterTable that
restores a sizable table, on a resuming PS), refuses the requests that come after it began
(UNAVAILABLE) and ends as soon as nothing is in flight."""

import asyncio
import json
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from paramserver.checkpoint.store import CheckpointStore
from paramserver.transport import stream as stream_mod
from paramserver.wire import codec

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


# ---- a request in flight on the tensor stream ------------------------------------------------------------
TABLE = {"table": "t", "dim": 32, "optimizer": {"name": "adagrad", "hyper": {"lr": 0.1}},
         "init": {"kind": "normal", "std": 0.1}}
ROWS = 300_000  # a sizable table: its restore is the slow request
STREAM_GRACE_S = 30.0  # the bound; the drain ends as soon as the request in flight has its reply
PREFIX = struct.Struct("<4sBBHQ")


def stream_request(method: str, meta: dict) -> bytes:
    """The bytes of a request on the tensor stream (prefix and frame), to send whole or in pieces."""
    frame = codec.encode(meta)
    return PREFIX.pack(stream_mod.MAGIC, stream_mod.REQUEST, 0, stream_mod.METHODS.index(method), len(frame)) + frame


def stream_reply(sock: socket.socket) -> tuple[int, bytes] | None:
    """(status, payload) of the next reply; None when the PS closed the connection without one."""
    data = b""
    try:
        while len(data) < PREFIX.size:
            chunk = sock.recv(PREFIX.size - len(data))
            if not chunk:
                return None
            data += chunk
        _, _, status, _, size = PREFIX.unpack(data)
        body = b""
        while len(body) < size:
            chunk = sock.recv(size - len(body))
            if not chunk:
                return None
            body += chunk
    except ConnectionResetError:
        return None
    return status, body


def checkpoint_with_a_table(procs, directory) -> None:
    """Checkpoint ckpt-000000001 of one PS holding table t with ROWS rows."""
    options = json.dumps({"checkpoint_dir": str(directory)})
    proc, address = procs.start_ps(PARAMSERVER_OPTIONS=options)
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
    try:
        def call(method: str, meta: dict, tensors=()) -> codec.Frame:
            stub = channel.unary_unary(f"/paramserver.Shard/{method}")
            return codec.decode(stub(codec.encode(meta, list(tensors)), timeout=120))

        call("RegisterTable", TABLE)
        ids = np.arange(ROWS, dtype=np.int64)
        for lo in range(0, ROWS, 50_000):
            call("Lookup", {"table": "t"}, [("ids", ids[lo:lo + 50_000])])
        entry = call("Checkpoint", {"name": "ckpt-000000001"}).meta
    finally:
        channel.close()
        proc.kill()
        proc.wait(30)
    CheckpointStore(str(directory)).commit("ckpt-000000001", {"step": 1, "num_shards": 1, "shards": [entry]})


class Log:
    """A process's stderr, read by a thread; `wait_for(text)` waits for a line holding it."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), name="ps-stderr", daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()

    def wait_for(self, text: str, timeout: float) -> str:
        with self._changed:
            found = self._changed.wait_for(lambda: next((line for line in self.lines if text in line), None), timeout)
        assert found, f"no log line with {text!r} in {timeout:.0f}s; the log:\n{''.join(self.lines)[-3000:]}"
        return found


def test_a_stream_request_in_flight_at_sigterm_gets_its_reply_and_later_ones_are_refused(procs, tmp_path):
    directory = tmp_path / "ckpt"
    checkpoint_with_a_table(procs, directory)
    options = {"checkpoint_dir": str(directory), "resume": True, "drain_grace_s": STREAM_GRACE_S}
    proc = procs.start([sys.executable, "-m", "paramserver", "node", "--role", "ps", "--index", "0",
                        "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=procs.env(PARAMSERVER_OPTIONS=json.dumps(options)))
    line = proc.stdout.readline()
    assert line.startswith("PARAMSERVER_READY"), line
    log = Log(proc.stderr)
    channel = grpc.insecure_channel(line.split()[-1])
    hello = codec.decode(channel.unary_unary("/paramserver.Shard/Hello")(codec.encode({}), timeout=30)).meta
    channel.close()
    port = hello["stream_port"]
    slow = socket.create_connection(("127.0.0.1", port), timeout=60)
    idle = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        for sock in (slow, idle):
            sock.sendall(stream_request("Hello", {}))
            assert stream_reply(sock)[0] == 0  # admitted; its thread waits for the next prefix
        # the RegisterTable that restores the table is in flight: its prefix is read, the rest of it comes later
        register = stream_request("RegisterTable", TABLE)
        slow.sendall(register[:PREFIX.size + 8])
        time.sleep(0.5)  # the PS reads the prefix at once: the drain's log line says it was in flight
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        log.wait_for("draining", 30)
        drain = log.wait_for("requests in flight", 10)
        assert "1 requests in flight" in drain, drain

        idle.sendall(stream_request("Hello", {}))  # after the drain began: refused, and said why
        status, message = stream_reply(idle) or (None, b"")
        assert status == grpc.StatusCode.UNAVAILABLE.value[0] and b"draining" in message, (status, message)
        with pytest.raises(OSError):  # and no new connection is taken
            socket.create_connection(("127.0.0.1", port), timeout=5).close()

        slow.sendall(register[PREFIX.size + 8:])
        answer = stream_reply(slow)
        assert answer is not None and answer[0] == 0, (answer, "".join(log.lines)[-3000:])
        answered = time.monotonic() - started
        code = proc.wait(STREAM_GRACE_S + 5)
        took = time.monotonic() - started
    finally:
        slow.close()
        idle.close()
    text = "".join(log.lines)
    assert code == 0 and f"table t restored with {ROWS} rows" in text and "drained in" in text, text[-3000:]
    assert took < STREAM_GRACE_S and took - answered < 5, (answered, took)  # done once the request was answered
    print(f"answered {answered:.2f}s after SIGTERM, exited {took:.2f}s after it")
    assert procs.leftovers() == []
