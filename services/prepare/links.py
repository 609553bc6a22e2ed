"""prepare's streams to its peers (gRPC plumbing only; ``lanes.py`` and ``connector.py`` drive them).

- :class:`DeviceLink`: ``Device.Attach``, then the bidi ``Device.Execute`` stream (plans out,
  receipts in, read by a thread).
- :class:`DeviceReadiness`: the device's readiness through ``grpc.health.v1`` (checked before
  attaching, then watched), so a draining device stops getting new requests.
- :class:`ReclaimLink`: the ``Reclaim.Subscribe`` stream (``StepEvents`` in, read by a thread).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stageserve.v1 import device_pb2, device_pb2_grpc, reclaim_pb2, reclaim_pb2_grpc

PEER_NAME = "prepare"
ATTACH_TIMEOUT_S = 10.0
SUBSCRIBE_CONFIRM_S = 2.0  # how long to wait for reclaim's response headers before trusting the stream anyway
HEALTH_CHECK_TIMEOUT_S = 5.0
DEVICE_SERVICE_NAME = device_pb2.DESCRIPTOR.services_by_name["Device"].full_name  # its readiness entry


class DeviceLink:
    """One ``Execute`` stream to the device.

    Args:
        channel: a channel to the device.
        on_receipt: called with each ``StepReceipt`` on the reader thread.
        on_lost: called once with a reason when the stream ends or breaks (not after :meth:`close`).
    """

    def __init__(self, channel: grpc.Channel, on_receipt: Callable[[device_pb2.StepReceipt], None], on_lost: Callable[[str], None]) -> None:
        self._stub = device_pb2_grpc.DeviceStub(channel)
        self._on_receipt, self._on_lost = on_receipt, on_lost
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._call = None
        self._closed = threading.Event()

    def attach(self) -> device_pb2.AttachReply:
        """Handshake: the device's model facts and limits.

        Raises:
            grpc.RpcError: the device did not answer (not up yet, or failing).
        """
        return self._stub.Attach(device_pb2.AttachRequest(peer=PEER_NAME), timeout=ATTACH_TIMEOUT_S)

    def open(self) -> None:
        """Open the ``Execute`` stream and start reading receipts."""
        self._call = self._stub.Execute(self._plans())
        threading.Thread(target=self._read, name="prepare-device-receipts", daemon=True).start()

    def send(self, plan: device_pb2.StepPlan) -> None:
        """Queue ``plan`` on the stream (never blocks; gRPC sends in queue order)."""
        self._outbox.put(plan)

    def close(self) -> None:
        self._closed.set()
        self._outbox.put(None)
        if self._call is not None:
            self._call.cancel()

    def _plans(self):
        while (plan := self._outbox.get()) is not None:
            yield plan

    def _read(self) -> None:
        try:
            for receipt in self._call:
                self._on_receipt(receipt)
            reason = "the device closed the Execute stream"
        except grpc.RpcError as exc:
            reason = f"the device's Execute stream broke ({exc.code().name}: {exc.details()})"
        if not self._closed.is_set():
            self._on_lost(reason)


class DeviceReadiness:
    """The device's readiness (health status of ``stageserve.v1.Device``).

    Args:
        channel: a channel to the device.
        on_change: called with ``True``/``False`` on each status the watch receives (on its reader
            thread), and with ``False`` when the watch ends (not after :meth:`close`).
    """

    def __init__(self, channel: grpc.Channel, on_change: Callable[[bool], None]) -> None:
        self._stub = health_pb2_grpc.HealthStub(channel)
        self._on_change = on_change
        self._call = None
        self._closed = threading.Event()

    def check(self) -> bool:
        """Whether the device is ready now (SERVING: warmed up and not draining).

        Raises:
            grpc.RpcError: the device did not answer.
        """
        request = health_pb2.HealthCheckRequest(service=DEVICE_SERVICE_NAME)
        return self._stub.Check(request, timeout=HEALTH_CHECK_TIMEOUT_S).status == health_pb2.HealthCheckResponse.SERVING

    def watch(self) -> None:
        """Start watching: every status change goes to ``on_change``."""
        self._call = self._stub.Watch(health_pb2.HealthCheckRequest(service=DEVICE_SERVICE_NAME))
        threading.Thread(target=self._read, name="prepare-device-readiness", daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        if self._call is not None:
            self._call.cancel()

    def _read(self) -> None:
        try:
            for reply in self._call:
                self._on_change(reply.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            pass  # the device went away; its Execute stream reports that
        if not self._closed.is_set():
            self._on_change(False)


class ReclaimLink:
    """One ``Subscribe`` stream from reclaim.

    Args:
        channel: a channel to reclaim.
        on_step_events: called with each ``StepEvents`` on the reader thread.
        on_lost: called once with a reason when the stream ends or breaks (not after :meth:`close`).
    """

    def __init__(self, channel: grpc.Channel, on_step_events: Callable[[reclaim_pb2.StepEvents], None], on_lost: Callable[[str], None]) -> None:
        self._stub = reclaim_pb2_grpc.ReclaimStub(channel)
        self._on_step_events, self._on_lost = on_step_events, on_lost
        self._call = None
        self._closed = threading.Event()
        self._failed: grpc.RpcError | None = None
        self._settled = threading.Event()  # headers arrived, or the call failed

    def open(self) -> None:
        """Subscribe, and wait (up to 2 s) for reclaim's response headers, which a reclaim that
        registers its subscriber before sending them turns into a guarantee that no step published
        from now on is missed.

        Raises:
            grpc.RpcError: reclaim refused or did not answer.
        """
        self._call = self._stub.Subscribe(reclaim_pb2.SubscribeRequest(peer=PEER_NAME))
        threading.Thread(target=self._read, name="prepare-reclaim-events", daemon=True).start()
        threading.Thread(target=self._await_headers, name="prepare-reclaim-headers", daemon=True).start()
        self._settled.wait(SUBSCRIBE_CONFIRM_S)
        if self._failed is not None:
            raise self._failed

    def close(self) -> None:
        self._closed.set()
        if self._call is not None:
            self._call.cancel()

    def _await_headers(self) -> None:
        try:
            self._call.initial_metadata()
        finally:
            self._settled.set()

    def _read(self) -> None:
        try:
            for step_events in self._call:
                self._on_step_events(step_events)
            reason = "reclaim closed the Subscribe stream"
        except grpc.RpcError as exc:
            self._failed = exc
            reason = f"reclaim's Subscribe stream broke ({exc.code().name}: {exc.details()})"
        self._settled.set()
        if not self._closed.is_set():
            self._on_lost(reason)
