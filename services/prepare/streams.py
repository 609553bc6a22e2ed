"""prepare's streams to its peers (gRPC plumbing only; ``session.py`` and ``connector.py`` drive them).

- :class:`ExecuteStream`: ``Device.Attach``, then the bidi ``Device.Execute`` stream (plans out,
  receipts of refused plans in).
- :class:`DeviceReadiness`: the device's readiness through ``grpc.health.v1`` (checked before
  attaching, then watched), so a draining device stops getting new requests.
- :class:`ReclaimSubscription`: the ``Reclaim.Subscribe`` stream (``StepEvents`` in).

Each reads its responses on a thread of its own and reports how the stream ended, unless it was
closed first.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stageserve.v1 import device_pb2, device_pb2_grpc, reclaim_pb2, reclaim_pb2_grpc

PEER_NAME = "prepare"  # how prepare names itself to its peers
ATTACH_TIMEOUT_S = 10.0
COMPILE_TIMEOUT_S = 60.0  # a CompileConstraint call: the device's turn wait and compile budget, with room
HEALTH_CHECK_TIMEOUT_S = 5.0
SUBSCRIBE_CONFIRM_S = 2.0  # how long to wait for reclaim's response headers before trusting the stream anyway
DEVICE_SERVICE_NAME = device_pb2.DESCRIPTOR.services_by_name["Device"].full_name  # its readiness entry


class _ReadStream:
    """A call whose responses a thread reads: each to ``on_response``; then, unless :meth:`close`
    came first, a reason to ``on_lost``: ``ended`` when the peer ended the call, else ``broke``
    and the status."""

    def __init__(self, on_response: Callable[[object], None], on_lost: Callable[[str], None], ended: str, broke: str) -> None:
        self._on_response, self._on_lost = on_response, on_lost
        self._ended_reason, self._broke_reason = ended, broke
        self._call = None
        self._closed = threading.Event()

    def close(self) -> None:
        """Cancel the call; its end is not reported."""
        self._closed.set()
        if self._call is not None:
            self._call.cancel()

    def _start_reading(self, call, thread_name: str) -> None:
        self._call = call
        threading.Thread(target=self._read, name=thread_name, daemon=True).start()

    def _read(self) -> None:
        error = None
        try:
            for response in self._call:
                self._on_response(response)
        except grpc.RpcError as exc:
            error = exc
        self._ended(error)

    def _ended(self, error: grpc.RpcError | None) -> None:
        """The call ended: cleanly (``error`` is ``None``) or with ``error`` (a cancel by :meth:`close` too)."""
        if not self._closed.is_set():
            self._on_lost(self._ended_reason if error is None else f"{self._broke_reason} ({error.code().name}: {error.details()})")


class ExecuteStream(_ReadStream):
    """prepare's ``Device.Attach`` call and ``Device.Execute`` stream to one device.

    Args:
        channel: a channel to the device.
        on_receipt: called with each ``StepReceipt`` on the reader thread.
        on_lost: called once with a reason when the stream ends or breaks (not after :meth:`close`).
    """

    def __init__(self, channel: grpc.Channel, on_receipt: Callable[[device_pb2.StepReceipt], None], on_lost: Callable[[str], None]) -> None:
        super().__init__(on_receipt, on_lost, "the device closed the Execute stream", "the device's Execute stream broke")
        self._stub = device_pb2_grpc.DeviceStub(channel)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()

    def attach(self) -> device_pb2.AttachReply:
        """Handshake: the device's model facts and limits.

        Raises:
            grpc.RpcError: the device did not answer (not up yet, or failing).
        """
        return self._stub.Attach(device_pb2.AttachRequest(peer=PEER_NAME), timeout=ATTACH_TIMEOUT_S)

    def compile_constraint(self, constraint, tenant: str, done: Callable[[grpc.Future], None]) -> None:
        """Ask the device to compile ``constraint`` (a ``common_pb2.Constraint``) for ``tenant``
        (``CompileConstraint``, never blocks); ``done`` gets the call's future when it ends."""
        request = device_pb2.CompileConstraintRequest(constraint=constraint, tenant=tenant)
        self._stub.CompileConstraint.future(request, timeout=COMPILE_TIMEOUT_S).add_done_callback(done)

    def open(self) -> None:
        """Open the ``Execute`` stream and start reading receipts."""
        self._start_reading(self._stub.Execute(iter(self._outbox.get, None)), "prepare-device-receipts")

    def send(self, plan: device_pb2.StepPlan) -> None:
        """Queue ``plan`` on the stream (never blocks; gRPC sends in queue order)."""
        self._outbox.put(plan)

    def close(self) -> None:
        self._outbox.put(None)  # ends the request iterator
        super().close()


class DeviceReadiness(_ReadStream):
    """The device's readiness (health status of ``stageserve.v1.Device``).

    Args:
        channel: a channel to the device.
        on_change: called with ``True``/``False`` on each status the watch receives (on its reader
            thread), and with ``False`` when the watch ends (not after :meth:`close`).
    """

    def __init__(self, channel: grpc.Channel, on_change: Callable[[bool], None]) -> None:
        # The watch ending means the device went away (its Execute stream says why): not ready.
        super().__init__(lambda response: on_change(response.status == health_pb2.HealthCheckResponse.SERVING),
                         lambda _reason: on_change(False), "", "")
        self._stub = health_pb2_grpc.HealthStub(channel)

    def check(self, timeout_s: float = HEALTH_CHECK_TIMEOUT_S) -> bool:
        """Whether the device is ready now (SERVING: warmed up and not draining).

        Raises:
            grpc.RpcError: the device did not answer within ``timeout_s`` seconds.
        """
        request = health_pb2.HealthCheckRequest(service=DEVICE_SERVICE_NAME)
        return self._stub.Check(request, timeout=timeout_s).status == health_pb2.HealthCheckResponse.SERVING

    def watch(self) -> None:
        """Start watching: every status change goes to ``on_change``."""
        self._start_reading(self._stub.Watch(health_pb2.HealthCheckRequest(service=DEVICE_SERVICE_NAME)), "prepare-device-readiness")


class ReclaimSubscription(_ReadStream):
    """prepare's ``Reclaim.Subscribe`` stream.

    Args:
        channel: a channel to reclaim.
        on_step_events: called with each ``StepEvents`` on the reader thread.
        on_lost: called once with a reason when the stream ends or breaks (not after :meth:`close`).
    """

    def __init__(self, channel: grpc.Channel, on_step_events: Callable[[reclaim_pb2.StepEvents], None], on_lost: Callable[[str], None]) -> None:
        super().__init__(on_step_events, on_lost, "reclaim closed the Subscribe stream", "reclaim's Subscribe stream broke")
        self._stub = reclaim_pb2_grpc.ReclaimStub(channel)
        self._failed: grpc.RpcError | None = None
        self._settled = threading.Event()  # headers arrived, or the call failed

    def open(self) -> None:
        """Subscribe, and wait (up to 2 s) for reclaim's response headers, which a reclaim that
        registers its subscriber before sending them turns into a guarantee that no step published
        from now on is missed.

        Raises:
            grpc.RpcError: reclaim refused or did not answer.
        """
        self._start_reading(self._stub.Subscribe(reclaim_pb2.SubscribeRequest(peer=PEER_NAME)), "prepare-reclaim-events")
        threading.Thread(target=self._await_headers, name="prepare-reclaim-headers", daemon=True).start()
        self._settled.wait(SUBSCRIBE_CONFIRM_S)
        if self._failed is not None:
            raise self._failed
        if self._call.done() and self._call.code() != grpc.StatusCode.OK:  # failed before the reader stored why
            raise self._call

    def _await_headers(self) -> None:
        try:
            self._call.initial_metadata()
        finally:
            self._settled.set()

    def _ended(self, error: grpc.RpcError | None) -> None:
        self._failed = error
        self._settled.set()
        super()._ended(error)
