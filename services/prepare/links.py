"""prepare's connections to its two peers, and the connector that keeps a session up.

- :class:`DeviceLink`: ``Device.Attach``, then the bidi ``Device.Execute`` stream (plans out,
  receipts in, read by a thread).
- :class:`ReclaimLink`: the ``Reclaim.Subscribe`` stream (``StepEvents`` in, read by a thread).
- :class:`PipelineConnector`: dials both with exponential backoff until they answer, opens an
  engine session, reports readiness SERVING only while both are up, and on the loss of either (a
  broken stream, or no publication of a sent step within ``--step-timeout``) ends the session (its
  requests fail with ``UNAVAILABLE``), closes both streams and dials again. A device that comes
  back with a new ``instance_id`` gets a fresh sequence table.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import grpc

from stageserve.prepare.engine import Engine
from stageserve.server import GRPC_OPTIONS
from stageserve.v1 import device_pb2, device_pb2_grpc, reclaim_pb2, reclaim_pb2_grpc

log = logging.getLogger(__name__)

PEER_NAME = "prepare"
ATTACH_TIMEOUT_S = 10.0
SUBSCRIBE_CONFIRM_S = 2.0  # how long to wait for reclaim's response headers before trusting the stream anyway
BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 5.0
WATCH_PERIOD_S = 0.5


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


class PipelineConnector:
    """Keeps one engine session up over a device and a reclaim connection (see the module docstring).

    Args:
        device_target, reclaim_target: ``HOST:PORT`` of the peers.
        engine: the step loop that gets the session.
        on_ready: called with ``True`` when a session opens and ``False`` when it closes.
        step_timeout_s: a sent step not published within this time counts as a lost reclaim.
    """

    def __init__(self, device_target: str, reclaim_target: str, engine: Engine, on_ready: Callable[[bool], None], step_timeout_s: float) -> None:
        self._device_channel = grpc.insecure_channel(device_target, options=GRPC_OPTIONS)
        self._reclaim_channel = grpc.insecure_channel(reclaim_target, options=GRPC_OPTIONS)
        self._targets = f"device {device_target}, reclaim {reclaim_target}"
        self._engine, self._on_ready, self._step_timeout_s = engine, on_ready, step_timeout_s
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._lost_reason = ""
        self._session = 0  # number of the current engine session; 0 = none
        self._sessions_opened = 0
        self._links: list[DeviceLink | ReclaimLink] = []
        self._thread = threading.Thread(target=self._run, name="prepare-connector", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop reconnecting, end the session and close both connections."""
        self._stop.set()
        self._lost.set()
        self._thread.join(timeout=10)
        self._device_channel.close()
        self._reclaim_channel.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            # 1. dial both peers (with backoff) and open an engine session
            if not self._connect():
                return
            self._on_ready(True)
            # 2. watch until a link is lost, a step is overdue, or we are stopped
            reason = self._watch()
            # 3. end the session: not ready, fail its requests, close the streams
            self._on_ready(False)
            self._engine.close_session(self._session, reason)
            self._session = 0
            self._close_links()

    def _connect(self) -> bool:
        delay = BACKOFF_INITIAL_S
        while not self._stop.is_set():
            self._lost.clear()
            device = DeviceLink(self._device_channel, self._receipt, self._link_lost)
            reclaim = ReclaimLink(self._reclaim_channel, self._step_events, self._link_lost)
            self._links = [device, reclaim]
            try:
                attach = device.attach()
                reclaim.open()
                device.open()
                self._session = self._sessions_opened = self._sessions_opened + 1  # set before any receipt can arrive
                self._engine.open_session(self._session, attach, device.send)
                log.info("attached to device %s (instance %s, %s, %d KV blocks) and subscribed to reclaim",
                         attach.model_name, attach.instance_id, attach.backend, attach.kv_num_blocks)
                return True
            except (grpc.RpcError, ValueError) as exc:
                detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)
                log.warning("cannot reach the pipeline (%s): %s; retrying in %.1f s", self._targets, detail, delay)
                self._close_links()
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
        return False

    def _watch(self) -> str:
        while not self._lost.wait(WATCH_PERIOD_S):
            overdue = self._engine.oldest_unpublished_step(self._session)
            if overdue is not None and overdue[1] > self._step_timeout_s:
                return f"reclaim published no events for step {overdue[0]} within {self._step_timeout_s:g} s"
        return "prepare is shutting down" if self._stop.is_set() else self._lost_reason

    def _link_lost(self, reason: str) -> None:
        if not self._lost.is_set():
            self._lost_reason = reason
            self._lost.set()

    def _receipt(self, receipt: device_pb2.StepReceipt) -> None:
        self._engine.on_receipt(self._session, receipt)

    def _step_events(self, step_events: reclaim_pb2.StepEvents) -> None:
        self._engine.on_step_events(self._session, step_events)

    def _close_links(self) -> None:
        for link in self._links:
            link.close()
        self._links = []
