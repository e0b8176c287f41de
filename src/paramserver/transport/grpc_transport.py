"""gRPC glue: serve a service object (shard or coordinator), and call one with deadlines and typed errors.

Payloads are raw frame bytes (no protobuf), sent through gRPC's generic handlers under
the service name ``paramserver.Shard``.

No gRPC message exceeds max_message_bytes. Every method `M` is served three ways: `M` (unary: request
and reply one message each), `M.ChunkedReply` (unary request, the reply streamed as consecutive
messages of at most max_message_bytes) and `M.Chunked` (both streamed). A shard channel calls
`M.ChunkedReply`, or `M.Chunked` when its request is longer than the limit, since a reply's size is
known only once it was made; the pieces put together are bounded by max_payload_bytes on both ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from concurrent.futures import Future

import grpc

from paramserver.base.config import Options
from paramserver.base.errors import ResourceExhaustedError, UnavailableError, error_for_status
from paramserver.base.lifecycle import Lifecycle, ReadyFlag
from paramserver.security.auth import bearer_metadata, bearer_token
from paramserver.security.tls import TlsMaterial
from paramserver.transport.channel import CallHandle, FutureCall
from paramserver.transport.dispatch import answer
from paramserver.transport.grpc_gate import TokenGate
from paramserver.transport.health import Health
from paramserver.transport.stream import METHODS as STREAM_METHODS
from paramserver.transport.stream import host_id
from paramserver.transport.stream_client import StreamClient
from paramserver.wire import codec
from paramserver.wire.codec import split_parts

log = logging.getLogger(__name__)
SERVICE = "paramserver.Shard"
CHUNKED_REPLY, CHUNKED = ".ChunkedReply", ".Chunked"  # method name suffixes: the reply, or both, in chunks
HEALTH_ONLY = "paramserver.HealthOnly"  # the service name of a server that serves health and nothing else
# service name -> what error messages (and thread names) call it
_PEER_KINDS = {"paramserver.Coordinator": "coordinator", HEALTH_ONLY: "health"}


_RECONNECT_BACKOFF_MS = (100, 5000)  # the first and the longest wait between connection attempts


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    # Large HTTP/2 frames and write buffers: a push or pull is megabytes, and gRPC's defaults (16 KiB
    # frames) cost more CPU per byte than the optimizer itself (docs/benchmarks/dense.md, "Where the time went").
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
        ("grpc.http2.write_buffer_size", 64 * 1024 * 1024),
        # gRPC waits 1 s after a refused connection before it tries again (and up to 120 s later on):
        # a worker that asked before the coordinator or a restarted PS listened lost that second.
        # Not grpc.min_reconnect_backoff_ms: it is also how long one attempt may take to connect (20 s),
        # which a handshake on busy cores can need
        ("grpc.initial_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", _RECONNECT_BACKOFF_MS[1]),
    ]


class GrpcServer(Lifecycle):
    """A gRPC server exposing one service object (`.methods` names, `.call(method, payload)`).

    Lifecycle (base/lifecycle.py): `start()` binds and returns the port; `wait_ready(timeout)`;
    `stop(grace)`: in-flight calls get `grace` seconds, then gRPC cancels them; the request threads
    ("ps-rpc_N", "coordinator-rpc_N") are joined, all within about `grace` + 1 s. gRPC's own
    polling thread is not ours to name; it ends with the server.
    With `tls`, the port serves TLS only (mutual when the material has a CA; security/tls.py).
    """

    def __init__(
        self,
        service,
        bind: str,
        max_message_bytes: int,
        threads: int = 8,
        service_name: str = SERVICE,
        tls: TlsMaterial | None = None,
        health: Health | None = None,
        max_payload_bytes: int = Options.max_payload_bytes,
    ) -> None:
        """`tls`: serve TLS (mutual with a CA); `health`: served next to the service (grpc.health.v1);
        `max_payload_bytes`: the most a chunked request may hold in all."""
        self.service = service
        self.max_message_bytes = max_message_bytes
        self.max_payload_bytes = max(max_payload_bytes, max_message_bytes)
        self.bind = bind
        self.tls = tls
        self.port: int | None = None
        self.ready = ReadyFlag(f"gRPC server on {bind}")
        self._threads: list[threading.Thread] = []  # the request threads, recorded as each one starts
        self._stopped = threading.Event()
        self._executor = futures.ThreadPoolExecutor(
            max_workers=threads,
            thread_name_prefix=f"{_PEER_KINDS.get(service_name, 'ps')}-rpc",
            initializer=lambda: self._threads.append(threading.current_thread()),
        )
        # no SO_REUSEPORT: a second server on a port in use fails at start instead of sharing it;
        # the gate checks tokens from a call's metadata before its request is read (grpc_gate.py)
        self._server = grpc.server(
            self._executor,
            interceptors=[TokenGate(service, service_name)],
            options=[*channel_options(max_message_bytes), ("grpc.so_reuseport", 0)],
        )
        handlers = {}
        for name in service.methods:
            handlers[name] = grpc.unary_unary_rpc_method_handler(self._handler(name))
            handlers[f"{name}{CHUNKED_REPLY}"] = grpc.unary_stream_rpc_method_handler(self._reply_handler(name))
            handlers[f"{name}{CHUNKED}"] = grpc.stream_stream_rpc_method_handler(self._chunked_handler(name))
        if handlers:
            self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_name, handlers),))
        if health is not None:
            health.add_to(self._server)

    def _handler(self, method: str):
        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            served = threading.Event()
            if hasattr(self.service, "caller_gone"):  # told at once when the caller cancels a call held here
                context.add_callback(lambda: _caller_gone(self.service, method, request, context, served))
            result = answer(
                self.service, method, request, context.peer(), token=bearer_token(context.invocation_metadata())
            )
            served.set()
            if not result.ok:
                context.abort(result.code, result.reply)
            return result.reply

        return handle

    def _reply_handler(self, method: str):
        def handle(request: bytes, context: grpc.ServicerContext):
            return self._reply_chunks(method, request, context)

        return handle

    def _chunked_handler(self, method: str):
        def handle(requests, context: grpc.ServicerContext):
            pieces, total = [], 0
            for piece in requests:
                total += len(piece)
                if total > self.max_payload_bytes:  # checked before the piece is kept
                    context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{method}: request of more than {total} "
                        f"bytes (chunked) exceeds max_payload_bytes {self.max_payload_bytes}",
                    )
                pieces.append(piece)
            if not pieces:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: a chunked request with no chunk")
            return self._reply_chunks(method, pieces[0] if len(pieces) == 1 else b"".join(pieces), context)

        return handle

    def _reply_chunks(self, method: str, request: bytes, context: grpc.ServicerContext):
        """The reply as messages of at most max_message_bytes (copied out under the call: reply buffers are reused)."""
        limit = self.max_message_bytes
        token = bearer_token(context.invocation_metadata())
        result = answer(
            self.service,
            method,
            request,
            context.peer(),
            token=token,
            sink=lambda parts: [b"".join(piece) for piece in split_parts(parts, limit)] or [b""],
        )
        if not result.ok:
            context.abort(result.code, result.reply)
        return iter(result.reply)

    def start(self) -> int:
        try:
            try:
                if self.tls is None:
                    self.port = self._server.add_insecure_port(self.bind)
                else:
                    self.port = self._server.add_secure_port(self.bind, self.tls.server_credentials())
            except RuntimeError as exc:  # grpcio raises this when the port is taken
                raise UnavailableError(f"cannot bind {self.bind}: the address is in use or not valid ({exc})") from None
            if not self.port:
                raise UnavailableError(f"cannot bind {self.bind}: the address is in use or not valid")
            self._server.start()
        except BaseException as exc:
            self.ready.fail(exc)
            raise
        self.ready.set()
        return self.port

    def wait_ready(self, timeout: float) -> None:
        """Serving as soon as `start` returned: this only says whether it did (and waits for it)."""
        self.ready.wait(timeout)

    def stop(self, grace: float = 2.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.ready.fail(UnavailableError(f"gRPC server on {self.bind} stopped"))
        deadline = time.monotonic() + grace + 1
        self._server.stop(grace).wait(grace + 1)
        self._executor.shutdown(wait=False, cancel_futures=True)
        for thread in list(self._threads):  # a handler still running its call (gRPC cancelled it)
            thread.join(max(0.5, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("%s still busy after stop(%.1f)", thread.name, grace)


class _NoMethods:
    """The service of a health-only server."""

    methods: dict = {}


def _caller_gone(service, method: str, request: bytes, context: grpc.ServicerContext, served: threading.Event) -> None:
    """The call ended before it was served (gRPC's termination callback): unless its deadline passed,
    the caller cancelled it: its process is gone (its connection closed) or it gave up. A service that
    cares (a long poll's caller: the coordinator's heartbeats) has `caller_gone(method, request)`."""
    remaining = context.time_remaining()
    if not served.is_set() and (remaining is None or remaining > 0):
        try:
            service.caller_gone(method, request)
        except Exception:  # gRPC's callback thread must not die of it; the heartbeat timeout still finds it
            log.exception("%s: telling the service its caller went away failed", method)


def health_server(health: Health, bind: str, tls: TlsMaterial | None = None) -> GrpcServer:
    """A gRPC server with only the health service (one request thread, "health-rpc_0"; Watch streams
    hold none): what a plain worker binds on its cluster address. Lifecycle as GrpcServer's."""
    return GrpcServer(_NoMethods(), bind, 4 << 20, threads=1, service_name=HEALTH_ONLY, tls=tls, health=health)


class GrpcChannel:
    """A ShardChannel to `address` ("host:port"): gRPC for control, the tensor stream for bulk calls.

    `wait_ready` must succeed before `call`; it says Hello over gRPC (which checks the protocol
    version) and learns the shard's stream port and host. With `use_stream=False` every call goes
    over gRPC; with `use_shared_memory=False` the stream never uses shared memory. With `tls`,
    gRPC and the stream both use TLS, and the server must prove it is the host of `address`.
    With `token`, every gRPC call carries it ("authorization: Bearer <token>") and the stream
    presents it once.
    Thread-safe.
    """

    def __init__(
        self,
        address: str,
        max_message_bytes: int,
        use_stream: bool = True,
        use_shared_memory: bool = True,
        service_name: str = SERVICE,
        tls: TlsMaterial | None = None,
        token: str | None = None,
        max_payload_bytes: int = Options.max_payload_bytes,
    ) -> None:
        self.address = address
        self.service_name = service_name
        self.use_shared_memory = use_shared_memory
        self.max_message_bytes = max_message_bytes
        self.max_payload_bytes = max(max_payload_bytes, max_message_bytes)
        self._chunked = service_name == SERVICE  # a shard's replies may be large; the coordinator's never are
        self.use_stream = use_stream
        self.tls = tls
        options = channel_options(max_message_bytes)
        self._channel = (
            grpc.insecure_channel(address, options=options)
            if tls is None
            else grpc.secure_channel(address, tls.channel_credentials(), options=options)
        )
        self._methods: dict[str, grpc.UnaryUnaryMultiCallable] = {}
        self._stream: StreamClient | None = None
        self._token = token
        self._metadata = bearer_metadata(token)

    def call(self, method: str, payload: bytes | list, timeout: float, owned: bool = False) -> CallHandle:
        # Hello always asks the PS process on gRPC: a restarted PS may serve its stream on another port
        if self._stream is not None and method in STREAM_METHODS and method != "Hello":
            return self._stream.call(method, payload, timeout, owned)
        if self._chunked:
            return self._call_chunked(method, payload, timeout)
        stub = self._methods.get(method)
        if stub is None:
            stub = self._methods[method] = self._channel.unary_unary(f"/{self.service_name}/{method}")
        result: Future = Future()
        call = stub.future(
            payload if isinstance(payload, bytes) else b"".join(payload), timeout=timeout, metadata=self._metadata
        )
        call.add_done_callback(lambda done: self._settle(done, result, method))
        return FutureCall(result, f"{self.address} {method}")

    def _call_chunked(self, method: str, payload: bytes | list, timeout: float) -> CallHandle:
        """The call with its reply in chunks, and its request too when longer than max_message_bytes."""
        parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        size = codec.parts_size(parts)
        describe = f"{self.address} {method}"
        if size > self.max_payload_bytes:
            result: Future = Future()
            result.set_exception(
                ResourceExhaustedError(
                    f"{describe}: request of {size} bytes exceeds max_payload_bytes {self.max_payload_bytes}"
                )
            )
            return FutureCall(result, describe)
        whole = size <= self.max_message_bytes
        name = f"/{self.service_name}/{method}{CHUNKED_REPLY if whole else CHUNKED}"
        stub = self._methods.get(name)
        if stub is None:
            stub = self._methods[name] = (
                self._channel.unary_stream(name) if whole else self._channel.stream_stream(name)
            )
        request: bytes | Iterator[bytes]
        if whole:
            request = payload if isinstance(payload, bytes) else b"".join(parts)
        else:  # copied now: the caller may reuse its buffers once `call` returns
            request = iter([b"".join(piece) for piece in split_parts(parts, self.max_message_bytes)])
        return ChunkedCall(stub(request, timeout=timeout, metadata=self._metadata), describe, self.max_payload_bytes)

    def _settle(self, call: grpc.Future, result: Future, method: str) -> None:
        try:
            result.set_result(call.result())
        except grpc.RpcError as exc:
            result.set_exception(error_for_status(exc.code(), f"{self.address} {method}: {exc.details()}"))

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            hint = (
                "" if self.tls is None else " (TLS: does it serve TLS, with a certificate for this host from our CA?)"
            )
            raise UnavailableError(
                f"{self.peer_kind} {self.address} not reachable within {timeout:.1f}s{hint}"
            ) from None
        reply = codec.decode(
            self.call("Hello", codec.encode({}), max(0.1, deadline - time.monotonic())).wait(
                max(0.1, deadline - time.monotonic())
            )
        )
        self.hello = reply.meta  # the PS's latest Hello: its incarnation, what it holds
        port = reply.meta.get("stream_port")
        if self.use_stream and port and self._stream is None:
            host = self.address.rsplit(":", 1)[0]
            same_host = self.use_shared_memory and reply.meta.get("host_id") == host_id()
            self._stream = StreamClient(
                host,
                int(port),
                self.max_message_bytes,
                self.address,
                same_host,
                tls=None if self.tls is None else self.tls.client_context,
                token=self._token,
                max_payload_bytes=self.max_payload_bytes,
            )

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._channel.close()

    @property
    def peer_kind(self) -> str:
        """What this channel talks to, for error messages: "coordinator" or "parameter server"."""
        return _PEER_KINDS.get(self.service_name, "parameter server")


class ChunkedCall(CallHandle):
    """A gRPC call whose reply arrives in chunks, put together by `wait` in the caller's thread."""

    def __init__(self, responses, describe: str, max_payload_bytes: int) -> None:
        self._responses, self._describe, self._max = responses, describe, max_payload_bytes
        self._reply: bytes | None = None
        self._error: Exception | None = None

    def done(self) -> bool:
        return self._reply is not None or self._error is not None or self._responses.done()

    def wait_sent(self, timeout: float) -> None:
        """The request was copied before `call` returned: nothing to wait for."""

    def wait(self, timeout: float) -> bytes:
        if self._reply is None and self._error is None:
            self._collect()
        if self._error is not None:
            raise self._error
        assert self._reply is not None  # _collect set a reply or an error
        return self._reply

    def _collect(self) -> None:
        pieces, total = [], 0
        try:
            for piece in self._responses:
                total += len(piece)
                if total > self._max:
                    self._responses.cancel()
                    self._error = ResourceExhaustedError(
                        f"{self._describe}: reply of more than {total} bytes exceeds max_payload_bytes {self._max}"
                    )
                    return
                pieces.append(piece)
        except grpc.RpcError as exc:
            self._error = error_for_status(exc.code(), f"{self._describe}: {exc.details()}")
            return
        self._reply = pieces[0] if len(pieces) == 1 else b"".join(pieces)
