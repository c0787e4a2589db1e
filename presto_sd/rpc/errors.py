"""Engine errors <-> gRPC status codes, both directions, in one place (docs/design.md §3).

    InvalidArgumentError  INVALID_ARGUMENT     malformed tree / tensor / parameter
    SessionNotFoundError  NOT_FOUND            unknown, closed or expired session
    StaleBaseError        FAILED_PRECONDITION  a call built on another committed length
    LimitExceededError    RESOURCE_EXHAUSTED   sessions, KV bytes, context, tree, response or budget
                                               over a limit
    AlreadyExistsError    ALREADY_EXISTS       a Prefill on an open session id, without restart; a
                                               request id that is already running
    UnauthenticatedError  UNAUTHENTICATED      missing or wrong token
    UnavailableError      UNAVAILABLE          model loading; (client side) unreachable
    DeadlineExpiredError  DEADLINE_EXCEEDED    the call's deadline passed before it ran

Anything else is a bug: INTERNAL, with the exception's type and message.
"""

from __future__ import annotations

import grpc

from presto_sd.engine.messages import (
    AlreadyExistsError,
    EngineError,
    InvalidArgumentError,
    LimitExceededError,
    SessionNotFoundError,
    StaleBaseError,
    UnauthenticatedError,
    UnavailableError,
)


class DeadlineExpiredError(EngineError):
    code = "DEADLINE_EXCEEDED"


class RemoteError(EngineError):
    """A status the client has no named error for (INTERNAL, UNKNOWN, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


_BY_CODE: dict[grpc.StatusCode, type[EngineError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: SessionNotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: StaleBaseError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitExceededError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}


# a server stopped mid-call cancels it: to the caller, that is the server going away
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a server answers for an exception an engine (or a conversion) raised."""
    from presto_sd.method.tree import TreeError, TreeLimitError  # servers only: clients stay torch-free

    if isinstance(exc, EngineError):
        return grpc.StatusCode[exc.code], str(exc)
    if isinstance(exc, TreeLimitError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, TreeError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def error_from_rpc(err: grpc.RpcError, unavailable: type[UnavailableError]) -> EngineError:
    """The named error for a failed call; ``unavailable`` when the server is away or too slow."""
    return error_from_status(err.code(), err.details() or "", unavailable)


def error_from_status(
    code: grpc.StatusCode | str, details: str, unavailable: type[UnavailableError]
) -> EngineError:
    """The named error for a status (or its name, as a batch item carries it)."""
    if isinstance(code, str):
        if code not in grpc.StatusCode.__members__:
            return RemoteError(code, details)
        code = grpc.StatusCode[code]
    if code in _UNAVAILABLE:
        return unavailable(f"{code.name}: {details}")
    cls = _BY_CODE.get(code)
    return cls(details) if cls is not None else RemoteError(code.name, details)
