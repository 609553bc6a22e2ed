"""The one exception type prepare raises for a request it cannot serve, carrying its gRPC status.

Validation, admission and the step loop raise :class:`RequestError`; the API layer turns it into
the gRPC status as is (``context.abort(error.code, error.message)``), so the message is written
for the client: it names the field or the resource and says what to change.
"""

from __future__ import annotations

import grpc

# grpc.StatusCode by its wire value, for status codes that arrive as numbers (SequenceEvent.error_code).
_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


class RequestError(Exception):
    """A request ends with (or is refused with) the gRPC status ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def from_wire(cls, code_value: int, message: str) -> "RequestError":
        """Build from a numeric gRPC status code (unknown values become ``INTERNAL``)."""
        return cls(_STATUS_BY_VALUE.get(code_value, grpc.StatusCode.INTERNAL), message)

    def __repr__(self) -> str:
        return f"RequestError({self.code.name}, {self.message!r})"


def invalid_argument(message: str) -> RequestError:
    """``INVALID_ARGUMENT``: a request field is wrong; ``message`` names it and the allowed range."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message)


def resource_exhausted(message: str) -> RequestError:
    """``RESOURCE_EXHAUSTED``: the waiting queue is full or the request can never fit the KV cache."""
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def unavailable(message: str) -> RequestError:
    """``UNAVAILABLE``: a pipeline peer is down, or the server is draining."""
    return RequestError(grpc.StatusCode.UNAVAILABLE, message)
