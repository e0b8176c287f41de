"""What a client needs from a connection to one shard, and the handle of a call in flight."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from paramserver.base.errors import DeadlineExceededError


class CallHandle:
    """A call in flight. `wait(timeout)` returns the reply or raises a ParamServerError.

    The reply may be a view that is valid only until the next call on the same channel.
    `wait_sent(timeout)` returns once the request's buffers were copied out, after which
    the caller may reuse them.
    """

    def done(self) -> bool:
        raise NotImplementedError

    def wait_sent(self, timeout: float) -> None:
        raise NotImplementedError

    def wait(self, timeout: float) -> bytes:
        raise NotImplementedError


class FutureCall(CallHandle):
    """A call run by another thread (gRPC's, or an executor's), finished through a Future."""

    def __init__(self, future: Future, describe: str) -> None:
        self._future = future
        self._describe = describe

    def done(self) -> bool:
        return self._future.done()

    def wait_sent(self, timeout: float) -> None:
        """gRPC serializes the request before `call` returns; nothing to wait for."""

    def wait(self, timeout: float) -> bytes:
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise DeadlineExceededError(f"{self._describe}: no reply within {timeout:.1f}s") from None


class ShardChannel(Protocol):
    """A connection to one shard service. Implementations are thread-safe."""

    address: str

    def call(self, method: str, payload: bytes | list, timeout: float, owned: bool = False) -> CallHandle:
        """Start `method` with `payload` (a frame, or its parts from codec.encode_parts); fails after `timeout` s.

        With `owned`, the reply stays valid whatever calls follow (else a large one may be a view
        that the next call on this channel overwrites)."""

    def wait_ready(self, timeout: float) -> None:
        """Say Hello once the shard can be called; raise UnavailableError after `timeout` seconds."""

    def close(self) -> None:
        """Release the connection; calls in flight fail."""
