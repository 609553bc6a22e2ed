"""The one exception type prepare raises for a request it cannot serve, carrying its gRPC status.

Validation, admission and the step loop raise :class:`RequestError`; the API layer turns it into
the gRPC status as is, with machine-readable details (``error_details.py``: ``ErrorInfo`` with
:attr:`RequestError.reason`, ``BadRequest`` naming :attr:`RequestError.field`, ``RetryInfo`` from
:attr:`RequestError.retry_after_s`), so the message is written for the client: it names the field
or the resource and says what to change.
"""

from __future__ import annotations

import grpc

# grpc.StatusCode by its wire value, for status codes that arrive as numbers (SequenceEvent.error_code).
_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


QUEUE_FULL_RETRY_S = 1.0  # RetryInfo of a full waiting queue: a few steps' worth of requests end by then

# The stable ErrorInfo reason of a status code, where the raiser names none.
_DEFAULT_REASONS = {
    grpc.StatusCode.INVALID_ARGUMENT: "INVALID_FIELD",
    grpc.StatusCode.ALREADY_EXISTS: "REQUEST_ID_IN_USE",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "KV_CAPACITY",
    grpc.StatusCode.UNAVAILABLE: "NOT_CONNECTED",
}


class RequestError(Exception):
    """A request ends with (or is refused with) the gRPC status ``code`` and ``message``.

    Args:
        reason: a stable upper-snake name of the cause for ``ErrorInfo`` (default: by ``code``,
            e.g. ``INVALID_FIELD``, ``NOT_CONNECTED``; else the code's name).
        retry_after_s: when retrying may succeed, in seconds (``RetryInfo``); ``None``: not said.
        field: the request field at fault (``BadRequest``); ``""``: none.
    """

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = "", retry_after_s: float | None = None,
                 field: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or _DEFAULT_REASONS.get(code, code.name)
        self.retry_after_s = retry_after_s
        self.field = field

    @classmethod
    def from_wire(cls, code_value: int, message: str) -> "RequestError":
        """Build from a numeric gRPC status code (unknown values become ``INTERNAL``)."""
        return cls(_STATUS_BY_VALUE.get(code_value, grpc.StatusCode.INTERNAL), message)

    def __repr__(self) -> str:
        return f"RequestError({self.code.name}, {self.message!r})"


def invalid_argument(message: str) -> RequestError:
    """``INVALID_ARGUMENT``: a request field is wrong; ``message`` starts with the field's name and
    a colon (``"top_p: 2 is ..."``: the ``BadRequest`` field) and says the allowed range."""
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, message, field=message.split(":", 1)[0])


def resource_exhausted(message: str, reason: str = "", retry_after_s: float | None = None) -> RequestError:
    """``RESOURCE_EXHAUSTED``: the waiting queue is full (``QUEUE_FULL``, retry later) or the
    request can never fit the KV cache (``KV_CAPACITY``, the default: retrying will not help)."""
    return RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, reason, retry_after_s)


def unavailable(message: str, reason: str = "", retry_after_s: float | None = None) -> RequestError:
    """``UNAVAILABLE``: a pipeline peer is down (``NOT_CONNECTED``, the default), a device stalled,
    or the server is draining (``DRAINING``)."""
    return RequestError(grpc.StatusCode.UNAVAILABLE, message, reason, retry_after_s)
