"""In-process twin of the gRPC transport: calls a ShardService directly, same bytes, same errors
(transport.dispatch answers for every transport).

For fast unit tests and for `paramserver.init()` in a plain `python script.py`. Calls run
synchronously on the caller's thread; the returned handle is already complete.
"""

from __future__ import annotations

from concurrent.futures import Future

from paramserver.transport.channel import CallHandle, FutureCall
from paramserver.transport.dispatch import answer
from paramserver.wire import codec


class InProcessChannel:
    """A ShardChannel to a service object (ShardService, CoordinatorService) in this process. Thread-safe."""

    def __init__(self, service, address: str | None = None, token: str | None = None) -> None:
        self.service = service
        self.token = token  # sent with every call, as a remote channel does (checked if the service has a guard)
        self.address = address or f"inprocess:shard{service.shard.index}"

    def call(self, method: str, payload: bytes | list, timeout: float, owned: bool = False) -> CallHandle:
        future: Future = Future()
        payload = payload if isinstance(payload, bytes) else b"".join(payload)
        result = answer(self.service, method, payload, "in-process", token=self.token)
        if result.ok:
            future.set_result(result.reply)
        else:
            future.set_exception(result.error(f"{self.address} {method}"))
        return FutureCall(future, f"{self.address} {method}")

    def wait_ready(self, timeout: float) -> None:
        """Say Hello, as a remote channel does (this checks the protocol version)."""
        self.call("Hello", codec.encode({}), timeout).wait(timeout)

    def close(self) -> None:
        return None
