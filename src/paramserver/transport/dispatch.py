"""One answer to a request, for every transport: gRPC, the tensor stream and the in-process twin
all call `answer`, so a request gets the same reply, status and message whichever way it came.

A service (ShardService, CoordinatorService) has `decode(method, payload)`, which decodes a
request frame once into a typed request (wire/calls.py), `claim(request)` (what it asks for, as
whom) and `serve(request, sink)`; each raises a ParamServerError for a refused request. Anything
else it raises is a bug, logged here and answered INTERNAL, and the transport keeps serving.

A service may carry a `guard` (security/auth.Guard): the caller's token is then checked before the
request is decoded, and its claim against the caller's role before it is served, so a refused call
changes nothing, and refusals and audited calls go to the audit log. A caller no token names (a node
without a token store) from another host gets what the service's `for_anonymous(request)` leaves of
its request (a shard's Hello: nothing about the process).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from paramserver.base.errors import ParamServerError, UnauthenticatedError, error_for_status
from paramserver.security.auth import ANONYMOUS, Claim, Guard

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


def answer(
    service, method: str, payload, peer: str, sink: Callable[[list], Any] = b"".join, token: str | None = None
) -> Answer:
    """Call `service` and turn what happens into an Answer. Thread-safe as the service is.
    `token`: the caller's bearer token, if it sent one.

    A service with a `calls` attribute (a base.metrics.CallMetrics) has every call recorded there,
    refused ones included (under their status code)."""
    calls = getattr(service, "calls", None)
    if calls is None:
        return _answer(service, method, payload, peer, sink, token)
    started = time.perf_counter()
    result = _answer(service, method, payload, peer, sink, token)
    calls.observe(method, result.code.name, time.perf_counter() - started, _size(payload), _size(result.reply))
    return result


def _size(data) -> int:
    """Bytes of a payload or reply (bytes, a memoryview, a str message, or the size a sink returned)."""
    if isinstance(data, int):
        return data
    if isinstance(data, memoryview):
        return data.nbytes
    if isinstance(data, list):  # a reply in chunks
        return sum(map(len, data))
    return len(data) if isinstance(data, (bytes, bytearray, str)) else 0


def _answer(service, method: str, payload, peer: str, sink: Callable[[list], Any], token: str | None) -> Answer:
    guard: Guard | None = getattr(service, "guard", None)
    principal, claim = None, None
    try:
        if guard is not None:
            principal = guard.authenticate(token, method)
        request = service.decode(method, payload)
        if guard is not None and principal is ANONYMOUS and not loopback(peer):
            request = getattr(service, "for_anonymous", lambda request: request)(request)
        if guard is not None and guard.needs_claim(method):
            claim = service.claim(request)
            assert principal is not None  # authenticated above: there is a guard
            guard.permit(principal, claim)
        result = Answer(grpc.StatusCode.OK, service.serve(request, sink))
        error = None
    except ParamServerError as exc:
        log.warning("%s refused from %s: %s", method, peer, exc)
        result, error = Answer(exc.code, str(exc)), exc
    except Exception:
        log.exception("%s from %s failed", method, peer)
        result = Answer(grpc.StatusCode.INTERNAL, f"{method} failed on the server; see its log")
        error = ParamServerError(result.reply)
    if guard is not None:
        guard.record(method, claim, principal or ANONYMOUS, peer, error)
    return result


def loopback(peer: str) -> bool:
    """Whether a peer, as a transport names it (gRPC "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000",
    "unix:...", the stream "('127.0.0.1', 5000)"), is on this host's loopback interface."""
    if peer.startswith("unix:"):
        return True
    if peer.startswith(("ipv4:", "ipv6:")):
        host = peer.split(":", 1)[1].rsplit(":", 1)[0].strip("[]")
    elif peer.startswith("("):
        host = peer[1:].split(",", 1)[0].strip("'\"")
    else:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def introduce(service, token: str, peer: str) -> UnauthenticatedError | None:
    """Check the token a tensor-stream connection presents once, before its first request; the
    refusal (None: accepted) is audited. Without a guard that checks tokens, every token is fine."""
    guard: Guard | None = getattr(service, "guard", None)
    if guard is None or not guard.checks:
        return None
    try:
        guard.authenticate(token)
        return None
    except UnauthenticatedError as exc:
        guard.record("StreamAuth", Claim("StreamAuth"), ANONYMOUS, peer, exc)
        return exc


def turned_away(service, what: str, peer: str, error: ParamServerError) -> None:
    """Audit a connection refused before any call on it (e.g. a failed TLS handshake on the stream)."""
    guard: Guard | None = getattr(service, "guard", None)
    if guard is not None:
        guard.record(what, Claim(what), ANONYMOUS, peer, error)


def needs_token(service) -> bool:
    """Whether `service` serves only callers with a known token."""
    guard: Guard | None = getattr(service, "guard", None)
    return guard is not None and guard.checks
