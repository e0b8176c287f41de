"""Typed errors of paramserver and their mapping to gRPC status codes.

Every error a caller can see is a subclass of :class:`ParamServerError`. Each class
carries the gRPC status code it travels as, so that a client rebuilds the same class
from the status code alone (never from the message text).
"""

from __future__ import annotations

import grpc


class ParamServerError(Exception):
    """Base class of every paramserver error."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgumentError(ParamServerError, ValueError):
    """A request is wrong in itself: bad shape, dtype, non-finite value, bad option.

    Also a ValueError, so that code written for torch (`except ValueError`) catches it."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class MalformedFrameError(InvalidArgumentError):
    """A binary frame could not be decoded."""


class NotFoundError(ParamServerError, LookupError):
    """A named variable or table does not exist on the shard. Also a LookupError."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(ParamServerError):
    """The request conflicts with the shard's state (e.g. a variable registered with another shape)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ProtocolVersionError(FailedPreconditionError):
    """The peer speaks a protocol version this node does not understand."""


class AlreadyExistsError(ParamServerError):
    """What a request would create exists already and is never overwritten (e.g. a committed checkpoint)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhaustedError(ParamServerError):
    """A request would exceed a limit the operator set (rows, table memory, message size, connections)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(ParamServerError):
    """A parameter server cannot be reached."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(UnavailableError):
    """A call did not complete before its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class UnauthenticatedError(ParamServerError):
    """A call carries no token, or one no token store on the node knows."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(ParamServerError):
    """A known caller asked for something outside its role, or acted as another worker."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ConfigError(ParamServerError, ValueError):
    """The cluster or node configuration is invalid. Raised before any node starts. Also a ValueError."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotInitializedError(ParamServerError, RuntimeError):
    """An API that needs a cluster was used before :func:`paramserver.init`. Also a RuntimeError,
    as torch.distributed raises before its process group exists."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class RollbackError(ParamServerError):
    """A PS or the chief restarted: the cluster goes back to its latest checkpoint, and this worker
    must restart to follow it (`paramserver node` exits with RESTART_EXIT_CODE for its restart loop)."""

    code = grpc.StatusCode.ABORTED


_BY_CODE: dict[grpc.StatusCode, type[ParamServerError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.ABORTED: RollbackError,
}


def error_for_status(code: grpc.StatusCode, message: str) -> ParamServerError:
    """The typed error a client raises for a failed call with this status code."""
    cls = _BY_CODE.get(code, ParamServerError)
    return cls(f"{message} [{code.name}]")
