"""Errors, split by whose fault they are, each mapped to one wire code.

A handler raises one of these; the server turns it into an error envelope. Anything else that
escapes a handler is a bug: it is logged with its traceback and answered as ``internal`` (the
traceback never leaves the process).
"""

from __future__ import annotations


class TetherError(Exception):
    """Base class. ``code`` is what travels on the wire."""

    code = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(TetherError):
    """The peer sent something malformed or meaningless (its fault)."""

    code = "bad_request"


class UnknownKind(BadRequest):
    code = "unknown_kind"


class VersionMismatch(TetherError):
    """The peer speaks no protocol version this side supports."""

    code = "version"


class PermissionDenied(TetherError):
    code = "permission_denied"


class NotFound(TetherError):
    code = "not_found"


class StateError(TetherError):
    """The request is well formed but not valid now (the caller's timing)."""

    code = "state"


class ResourceError(TetherError):
    """The request can never be satisfied on this node."""

    code = "resources"


class LaunchError(TetherError):
    """The operating system refused to do what was asked (the OS's fault)."""

    code = "launch"


class Busy(TetherError):
    """A door's cap was reached for this caller (connections, queued work): try again later."""

    code = "busy"


class LimitError(TetherError):
    """The caller's user is at one of her limits (pending jobs, her share of the state
    directory): nothing was changed; it passes as her jobs start or end."""

    code = "limit"


class Unavailable(TetherError):
    """The node cannot do it now (for instance its state directory is full); try later."""

    code = "unavailable"


class RemoteError(TetherError):
    """An error reply received from a peer, re-raised on the client side."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Unreachable(TetherError):
    """No answer within the deadline, or nobody listening at the endpoint."""

    code = "unreachable"


ERROR_CODES = {
    cls.code: cls
    for cls in (
        TetherError,
        BadRequest,
        UnknownKind,
        VersionMismatch,
        PermissionDenied,
        NotFound,
        StateError,
        ResourceError,
        LaunchError,
        Busy,
        LimitError,
        Unavailable,
    )
}
