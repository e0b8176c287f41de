"""What a client needs from a connection to one shard, and the handle of a call in flight."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from ..errors import DeadlineExceededError


class CallHandle:
    """A call in flight. `wait(timeout)` returns the reply bytes or raises a ParamServerError."""

    def __init__(self, future: Future, describe: str) -> None:
        self._future = future
        self._describe = describe

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float) -> bytes:
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise DeadlineExceededError(f"{self._describe}: no reply within {timeout:.1f}s") from None


class ShardChannel(Protocol):
    """A connection to one shard service. Implementations are thread-safe."""

    address: str

    def call(self, method: str, payload: bytes, timeout: float) -> CallHandle:
        """Start `method` with `payload`; the call fails after `timeout` seconds."""

    def wait_ready(self, timeout: float) -> None:
        """Return once the shard can be called; raise UnavailableError after `timeout` seconds."""

    def close(self) -> None:
        """Release the connection; calls in flight fail."""
