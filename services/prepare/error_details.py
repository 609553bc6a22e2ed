"""A :class:`~stageserve.prepare.errors.RequestError` as a ``google.rpc.Status`` with details.

Every error status of the public API carries, in the ``grpc-status-details-bin`` trailer (the
standard place, built by the ``grpcio-status`` package; clients decode it with
``grpc_status.rpc_status.from_call``):

- ``google.rpc.ErrorInfo``: ``reason`` a stable upper-snake name (``INVALID_FIELD``, ``QUEUE_FULL``,
  ``KV_CAPACITY``, ``REQUEST_ID_IN_USE``, ``DRAINING``, ``NOT_CONNECTED``, ``DEVICE_STALLED``, ...),
  ``domain`` ``stageserve.v1``;
- ``google.rpc.BadRequest`` with one field violation (the field's name, the message) for
  ``INVALID_ARGUMENT``;
- ``google.rpc.RetryInfo`` (``retry_delay``) where retrying later may succeed: a full queue, a
  draining server, a stalled or unreachable device.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from stageserve.prepare.errors import RequestError

ERROR_DOMAIN = "stageserve.v1"


def rich_status(error: RequestError) -> grpc.Status:
    """The gRPC status of ``error`` (code, message) with its ``google.rpc`` details in the trailer."""
    details = [error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN)]
    if error.field:
        violation = error_details_pb2.BadRequest.FieldViolation(field=error.field, description=error.message)
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    if error.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        details.append(error_details_pb2.RetryInfo(retry_delay=delay))
    packed = []
    for detail in details:
        any_detail = any_pb2.Any()
        any_detail.Pack(detail)
        packed.append(any_detail)
    return rpc_status.to_status(status_pb2.Status(code=error.code.value[0], message=error.message, details=packed))


async def abort_rpc(context: grpc.aio.ServicerContext, error: RequestError) -> None:
    """End the RPC with ``error``'s status and details (raises, as ``context.abort`` does)."""
    status = rich_status(error)
    await context.abort(status.code, status.details, status.trailing_metadata)
