"""Nothing before trust, on a real PS process that checks tokens (plaintext, no mutual TLS): gRPC
calls without an accepted token are refused from their metadata before their request is read, take
no memory and hold no request thread, and are audited (transport/grpc_gate.py, docs/security.md)."""

import json
import threading
import time

import grpc
import psutil
import pytest

from paramserver.security.tokens import write_tokens
from paramserver.transport.grpc_transport import channel_options
from paramserver.transport.health import check
from paramserver.wire import codec

pytestmark = pytest.mark.cluster  # a real PS process

BOUND_S = 60  # generous bound for waits on events; never a verdict
CHUNK = b"\0" * (16 << 20)  # one message of a chunked request (the client's max_message_bytes)


@pytest.fixture
def secured(procs, tmp_path):
    write_tokens(tmp_path / "tokens", ["ps-0", "worker-0", "admin"])
    audit = tmp_path / "audit.jsonl"
    options = {"auth_tokens": str(tmp_path / "tokens" / "tokens.json"), "audit_log": str(audit)}
    proc, address = procs.start_ps(PARAMSERVER_OPTIONS=json.dumps(options))
    return proc, address, tmp_path / "tokens", audit


def raw_channel(address):
    return grpc.insecure_channel(address, options=channel_options(1 << 30))


def chunked(channel, chunks, token=None, method="PushPull"):
    """A `M.Chunked` call sending `chunks` messages of 16 MiB; its status code."""
    call = channel.stream_stream(f"/paramserver.Shard/{method}.Chunked")
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    try:
        for _ in call((CHUNK for _ in range(chunks)), timeout=BOUND_S, metadata=metadata):
            pass
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


class PeakRss:
    """The highest RSS of a process while the block runs (sampled every 10 ms)."""

    def __init__(self, pid):
        self.process, self.peak, self._done = psutil.Process(pid), 0, threading.Event()

    def __enter__(self):
        self.before = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.wait(0.01):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join(BOUND_S)
        self.after = self.process.memory_info().rss


def test_unauthenticated_chunked_requests_take_no_memory_and_are_audited(secured):
    proc, address, tokens, audit = secured
    channel = raw_channel(address)
    grpc.channel_ready_future(channel).result(timeout=BOUND_S)
    ps_token = (tokens / "ps-0.token").read_text().strip()  # role ps: Hello only
    codes = []
    with PeakRss(proc.pid) as rss:  # 8 x 64 MiB at once, and one 256 MiB unary
        threads = [threading.Thread(target=lambda: codes.append(chunked(channel, 4)), name=f"anonymous-{i}")
                   for i in range(8)]
        for thread in threads:
            thread.start()
        unary = channel.unary_unary("/paramserver.Shard/PushPull")
        with pytest.raises(grpc.RpcError) as refused:
            unary(b"\0" * (256 << 20), timeout=BOUND_S)
        for thread in threads:
            thread.join(BOUND_S)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 8
    growth = (rss.peak - rss.before) / 2**20
    print(f"PS RSS {rss.before / 2**20:.0f} MiB before, peak {rss.peak / 2**20:.0f} MiB, "
          f"after {rss.after / 2**20:.0f} MiB")
    assert growth < 100, f"the PS grew by {growth:.0f} MiB reading requests it refused"
    # a known token whose role may not call the method: refused before its request is read too
    assert chunked(channel, 4, ps_token) == grpc.StatusCode.PERMISSION_DENIED
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    refusals = [(r["what"], r["who"], r["outcome"]) for r in records]
    assert refusals.count(("PushPull", "anonymous", "UNAUTHENTICATED")) == 9
    assert ("PushPull", "ps-0", "PERMISSION_DENIED") in refusals
    # the PS serves on: an admin's Hello is answered
    hello = channel.unary_unary("/paramserver.Shard/Hello")
    admin = (tokens / "admin.token").read_text().strip()
    reply = hello(codec.encode({}), timeout=BOUND_S, metadata=(("authorization", f"Bearer {admin}"),))
    assert codec.decode(reply).meta["shard"] == 0
    channel.close()


def test_slow_unauthenticated_streams_do_not_stall_hello_or_health(secured):
    _, address, tokens, _ = secured
    stop = threading.Event()

    def slow():  # one chunk, then nothing until the test ends: more streams than the PS has threads
        yield CHUNK[:1024]
        stop.wait(BOUND_S)

    channel = raw_channel(address)
    calls = [channel.stream_stream("/paramserver.Shard/PushPull.Chunked")(slow(), timeout=BOUND_S) for _ in range(12)]
    try:
        time.sleep(0.5)  # the streams arrived
        admin = (tokens / "admin.token").read_text().strip()
        hello = channel.unary_unary("/paramserver.Shard/Hello")
        started = time.monotonic()
        hello(codec.encode({}), timeout=BOUND_S, metadata=(("authorization", f"Bearer {admin}"),))
        assert check(address, BOUND_S) == "SERVING"
        took = time.monotonic() - started
        assert took < 5, f"Hello and health took {took:.1f}s behind slow unauthenticated streams"
        for call in calls:  # each was refused from its metadata, without waiting for its request
            with pytest.raises(grpc.RpcError) as refused:
                next(call)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        channel.close()


def stream_refusal(port, kind, size, body=b"", wait_close=True):
    """Send one stream message (its prefix declaring `size`, then `body`) on a fresh connection; the
    reply's (status, message), and whether the PS then closed the connection."""
    import socket
    import struct

    prefix = struct.Struct("<4sBBHQ")
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND_S) as sock:
        sock.sendall(prefix.pack(b"PSTS", kind, 0, 2, size) + body)  # method 2: PushPull
        data = b""
        while len(data) < prefix.size or len(data) < prefix.size + prefix.unpack(data[:prefix.size])[4]:
            chunk = sock.recv(1 << 16)
            assert chunk, "closed without a reply"
            data += chunk
        _, _, status, _, length = prefix.unpack(data[:prefix.size])
        message = data[prefix.size:prefix.size + length].decode()
        sock.settimeout(5 if wait_close else 0.01)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
        except ConnectionResetError:
            closed = True
    return status, message, closed


def test_stream_refusals_before_a_token_are_audited(secured):
    _, address, tokens, audit = secured
    channel = raw_channel(address)
    admin = (tokens / "admin.token").read_text().strip()
    hello = channel.unary_unary("/paramserver.Shard/Hello")
    reply = hello(codec.encode({}), timeout=BOUND_S, metadata=(("authorization", f"Bearer {admin}"),))
    port = codec.decode(reply).meta["stream_port"]
    channel.close()
    unauthenticated = grpc.StatusCode.UNAUTHENTICATED.value[0]
    # a 10 MiB request before a token: refused unread, the connection closed
    assert stream_refusal(port, 0, 10 << 20)[::2] == (unauthenticated, True)
    # an attach before a token: refused (the connection stays, pending)
    status, message, _ = stream_refusal(port, 4, 2, b"{}", wait_close=False)
    assert status == unauthenticated and "shared memory" in message
    # an auth message of 8 KiB: not a token, not read, the connection closed
    status, message, closed = stream_refusal(port, 5, 8192)
    assert (status, closed) == (unauthenticated, True) and "not a token" in message
    # a message past max_message_bytes (1 GiB)
    status, message, closed = stream_refusal(port, 0, 2 << 30)
    assert (status, closed) == (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], True)
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    refusals = [(r["what"], r["who"], r["outcome"]) for r in records]
    for expected in [("PushPull", "anonymous", "UNAUTHENTICATED"), ("StreamAttach", "anonymous", "UNAUTHENTICATED"),
                     ("StreamAuth", "anonymous", "UNAUTHENTICATED"), ("StreamFrame", "anonymous", "RESOURCE_EXHAUSTED")]:
        assert expected in refusals, (expected, refusals)
