"""One answer to a request, for every transport: gRPC, the tensor stream and the in-process twin
all call `answer`, so a request gets the same reply, status and message whichever way it came.

A service is any object with `call(method, payload, sink)` (ShardService, CoordinatorService)
that raises a ParamServerError for a refused request; anything else it raises is a bug, logged
here and answered INTERNAL, and the transport keeps serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import grpc

from ..base.errors import ParamServerError, error_for_status

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Answer:
    """`reply` is what the sink made of the reply when `code` is OK, else the error message."""

    code: grpc.StatusCode
    reply: Any

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK

    def error(self, describe: str) -> ParamServerError:
        """The typed error a client raises for this answer (`describe`: "address method")."""
        return error_for_status(self.code, f"{describe}: {self.reply}")


def answer(service, method: str, payload, peer: str, sink: Callable[[list], Any] = b"".join) -> Answer:
    """Call `service` and turn what happens into an Answer. Thread-safe as the service is.

    A service with a `calls` attribute (a base.metrics.CallMetrics) has every call recorded there."""
    calls = getattr(service, "calls", None)
    if calls is None:
        return _answer(service, method, payload, peer, sink)
    started = time.perf_counter()
    result = _answer(service, method, payload, peer, sink)
    calls.observe(method, result.code.name, time.perf_counter() - started, _size(payload), _size(result.reply))
    return result


def _size(data) -> int:
    """Bytes of a payload or reply (bytes, a memoryview, a str message, or the size a sink returned)."""
    if isinstance(data, int):
        return data
    if isinstance(data, memoryview):
        return data.nbytes
    return len(data) if isinstance(data, (bytes, bytearray, str)) else 0


def _answer(service, method: str, payload, peer: str, sink: Callable[[list], Any]) -> Answer:
    try:
        return Answer(grpc.StatusCode.OK, service.call(method, payload, sink))
    except ParamServerError as exc:
        log.warning("%s refused from %s: %s", method, peer, exc)
        return Answer(exc.code, str(exc))
    except Exception:  # noqa: BLE001 - a bug: report it to the caller and keep serving
        log.exception("%s from %s failed", method, peer)
        return Answer(grpc.StatusCode.INTERNAL, f"{method} failed on the server; see its log")
