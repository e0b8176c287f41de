"""Typed calls on a connection: a request message goes out as one frame, its reply comes back
as one typed message plus its tensors. The stubs (wire/stubs.py, generated from the message
tables) are thin names over `Stub.call`; `gather` waits for a fan-out under one deadline.

Both sides decode a frame once: a client with `Pending.wait`, a service with `decode_request`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from paramserver.base.deadline import Deadline
from paramserver.base.errors import NotFoundError
from paramserver.wire import codec
from paramserver.wire.message_fields import Message

R = TypeVar("R", bound=Message)
Tensors = Iterable[tuple[str, np.ndarray]]
Methods = dict[str, tuple[type[Message], type[Message]]]


class Handle(Protocol):
    """A call in flight on a channel (transport/channel.py's CallHandle)."""

    def wait_sent(self, timeout: float) -> None: ...

    def wait(self, timeout: float) -> Any: ...


class Channel(Protocol):
    """What a stub needs of a connection (transport/channel.py's ShardChannel)."""

    def call(self, method: str, payload: bytes | list, timeout: float, owned: bool = False) -> Handle: ...


class Pending(Generic[R]):
    """A typed call in flight: `wait(timeout)` returns (reply message, reply tensors)."""

    def __init__(self, handle: Handle, reply_type: type[R], size: int) -> None:
        self.handle, self.reply_type = handle, reply_type
        self.size = size  # bytes of the request frame

    def wait_sent(self, timeout: float) -> None:
        """Return once the request was copied out: its arrays may then change."""
        self.handle.wait_sent(timeout)

    def wait(self, timeout: float) -> tuple[R, dict[str, np.ndarray]]:
        """The reply; its tensors may view transport buffers until the next call on the channel."""
        frame = codec.decode(self.handle.wait(timeout))
        return self.reply_type.from_meta(frame.meta), frame.tensors


class Stub:
    """Typed calls on one channel of the service whose methods are `methods` (method: (request, reply))."""

    def __init__(self, channel: Channel, methods: Methods) -> None:
        self.channel, self.methods = channel, methods

    def call(
        self, method: str, request: Message, timeout: float, tensors: Tensors = (), owned: bool = False
    ) -> Pending[Any]:
        """Send `request` (with `tensors`) and return at once; fails after `timeout` seconds."""
        request_type, reply_type = self.methods[method]
        if not isinstance(request, request_type):
            raise TypeError(f"{method} takes a {request_type.__name__}, got {type(request).__name__}")
        payload = codec.encode_parts(request.to_meta(), tensors)
        return Pending(self.channel.call(method, payload, timeout, owned), reply_type, codec.parts_size(payload))


def gather(pending: Iterable[Pending[R]], timeout: float) -> list[tuple[R, dict[str, np.ndarray]]]:
    """Every reply of a fan-out, in order, all within one deadline of `timeout` seconds."""
    deadline = Deadline(timeout)
    return [call.wait(deadline.left()) for call in pending]


@dataclass
class Request:
    """A decoded request: its method, typed message and tensors (by name)."""

    method: str
    message: Any
    tensors: dict[str, np.ndarray]


def decode_request(service: str, methods: Methods, method: str, payload: Any) -> Request:
    """Decode a request frame once: an unknown method is NOT_FOUND, a bad field MALFORMED (naming it)."""
    if method not in methods:
        raise NotFoundError(f"{service} has no method {method!r}")
    frame = codec.decode(payload)
    return Request(method, methods[method][0].from_frame(frame.meta, frame.tensors), frame.tensors)
