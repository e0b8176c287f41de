"""Nothing read before trust on gRPC: a server interceptor that checks a call's token, and whether
its role may call the method at all, from the call's metadata, before a byte of its request is read.

Without it a node that checks tokens would read a whole unary request, or every chunk of a
`M.Chunked` stream (up to max_payload_bytes), before `dispatch.answer` found the token missing.
A call the gate refuses is answered by a handler that takes its request as a stream and never
reads it: gRPC then buffers no more of it than HTTP/2 flow control lets in (a window, not a
message), and the call ends at once, so an unauthenticated peer holds no request thread and no
memory. The refusal is audited and counted like any other (docs/security.md). A call that passes
is checked again, completely, by `dispatch.answer` once its request is read (the worker it acts
as, the form of the method it asks for).

Calls to other services (grpc.health.v1) pass: health needs no token.
"""

from __future__ import annotations

import logging

import grpc

from paramserver.base.errors import ParamServerError
from paramserver.security.auth import ANONYMOUS, Guard, Principal, bearer_token

log = logging.getLogger(__name__)


class TokenGate(grpc.ServerInterceptor):
    """Refuses calls to `service_name` whose metadata the service's guard does not admit."""

    def __init__(self, service, service_name: str) -> None:
        self.service = service
        self.prefix = f"/{service_name}/"

    def intercept_service(self, continuation, handler_call_details):
        guard: Guard | None = getattr(self.service, "guard", None)
        full = handler_call_details.method or ""
        if guard is None or not guard.checks or not full.startswith(self.prefix):
            return continuation(handler_call_details)
        method = full[len(self.prefix) :].split(".", 1)[0]  # "PushPull.Chunked" -> "PushPull"
        token = bearer_token(handler_call_details.invocation_metadata)
        principal = ANONYMOUS
        try:
            principal = guard.authenticate(token, method)  # an open method (Prove) needs none
            guard.permit_method(principal, method)
        except ParamServerError as exc:
            return self._refusal(guard, method, principal, exc)
        return continuation(handler_call_details)

    def _refusal(self, guard: Guard, method: str, principal: Principal, error: ParamServerError):
        """A handler that records the refusal and ends the call without reading its request."""

        def refuse(requests, context: grpc.ServicerContext):
            peer = context.peer()
            log.warning("%s refused from %s before its request was read: %s", method, peer, error)
            guard.record(method, None, principal, peer, error)
            calls = getattr(self.service, "calls", None)
            if calls is not None:
                calls.observe(method, error.code.name, 0.0, 0, len(str(error)))
            context.abort(error.code, str(error))

        # streamed request: gRPC reads a message only when the handler asks for one, and this one never does
        return grpc.stream_stream_rpc_method_handler(refuse)
