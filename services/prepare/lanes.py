"""One device endpoint as prepare serves it: a *lane*.

A lane owns that device's :class:`~stageserve.prepare.engine.Engine` (scheduler, KV block
bookkeeping, credits, step loop) and its connections (the ``Execute`` stream and a readiness
watch). Its thread keeps a session up:

1. wait until reclaim is subscribed (the connector says so);
2. dial with exponential backoff until the device is ready (health SERVING) and answers
   ``Attach``; open the ``Execute`` stream and an engine session;
3. watch until the ``Execute`` stream breaks, reclaim is lost, a sent step is not published within
   ``--step-timeout``, or the lane no longer accepts (the device turned NOT_SERVING: it drains; or
   its address left the DNS answer) and no request is left on it;
4. end the session: requests still in it fail with ``UNAVAILABLE`` (none when it was let go
   idle); then dial again (1.), unless the address left the DNS answer: then the thread ends and
   the connector drops the lane.

A lane *accepts* new requests only while attached, ready and listed. A request placed on it stays
on it until it ends: a draining device keeps its Execute stream until its last request finished,
and its drain waits for prepare to let it go.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from stageserve.prepare.engine import Engine
from stageserve.prepare.links import DeviceLink, DeviceReadiness
from stageserve.server import GRPC_OPTIONS
from stageserve.v1 import device_pb2, reclaim_pb2

log = logging.getLogger(__name__)

BACKOFF_INITIAL_S = 0.1
BACKOFF_MAX_S = 5.0
WATCH_PERIOD_S = 0.5  # how often an accepting lane looks for an overdue step
DRAIN_POLL_S = 0.1    # how often a lane that no longer accepts looks whether its last request ended


class DeviceLane:
    """One device endpoint's engine and connections (see the module docstring).

    Args:
        address: the device's ``HOST:PORT``.
        engine: the lane's engine (started by the lane, stopped by :meth:`stop`).
        reclaim_up: set while prepare is subscribed to reclaim.
        on_change: called (no arguments) when the lane attaches, detaches, or its readiness flips.
        step_timeout_s: a sent step not published within this time ends the session.
    """

    def __init__(self, address: str, engine: Engine, reclaim_up: threading.Event, on_change: Callable[[], None],
                 step_timeout_s: float) -> None:
        self.address = address
        self.engine = engine
        self.instance_id = ""  # of the attached device; "" while detached
        self._channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self._reclaim_up, self._on_change, self._step_timeout_s = reclaim_up, on_change, step_timeout_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._listed = True
        self._device_ready = False
        self._lost_reason = ""
        self._session = 0  # the engine session now open; 0 = none
        self._sessions_opened = 0
        self._thread = threading.Thread(target=self._run, name=f"prepare-lane-{address}", daemon=True)

    # ---- state, read by the connector and the router ---------------------------------------------
    @property
    def attached(self) -> bool:
        return self._session != 0

    @property
    def accepting(self) -> bool:
        """Whether new requests may be placed here: attached, the device ready, the address listed."""
        return self._session != 0 and self._device_ready and self._listed

    @property
    def finished(self) -> bool:
        """The lane's thread ended (its address left the DNS answer and its session is over)."""
        return self._thread.ident is not None and not self._thread.is_alive()

    # ---- control (connector) ------------------------------------------------------------------------
    def start(self) -> None:
        self.engine.start()
        self._thread.start()

    def stop(self) -> None:
        """End the session (requests still in it fail with ``UNAVAILABLE``), the engine and the channel."""
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=10)
        self.engine.stop()
        self._channel.close()

    def set_listed(self, listed: bool) -> None:
        """The address is (still) in the DNS answer, or left it: then no new requests, and the
        thread ends once the session is over."""
        if listed != self._listed:
            self._listed = listed
            self._wake.set()

    def wake(self) -> None:
        """Look at the state now (reclaim came up)."""
        self._wake.set()

    def reclaim_lost(self, reason: str) -> None:
        """reclaim's stream is gone: end the session (its events would never arrive)."""
        if self._session:
            self._link_lost(reason)

    def on_step_events(self, step_events: reclaim_pb2.StepEvents) -> None:
        """A step of this lane's device, published by reclaim (reclaim's reader thread)."""
        self.engine.on_step_events(self._session, step_events)

    # ---- the lane's thread --------------------------------------------------------------------------
    def _run(self) -> None:
        delay = BACKOFF_INITIAL_S
        while not self._stop.is_set() and self._listed:
            # 1. reclaim first: steps sent before the subscription would be published to nobody
            if not self._reclaim_up.is_set():
                self._sleep(WATCH_PERIOD_S)
                continue
            # 2. dial until the device is ready and attached
            links = self._connect()
            if links is None:
                self._sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            delay = BACKOFF_INITIAL_S
            # 3. watch; 4. end the session
            reason = self._watch()
            if reason is not None:
                self.engine.close_session(self._session, reason)
            self._detach(links)

    def _connect(self) -> tuple[DeviceLink, DeviceReadiness] | None:
        device = DeviceLink(self._channel, self._receipt, self._link_lost)
        readiness = DeviceReadiness(self._channel, self._readiness_changed)
        try:
            if not readiness.check():
                log.info("device %s is not ready (loading, or draining); retrying", self.address)
                return None
            attach = device.attach()
            self._lost_reason = ""
            self._device_ready = True
            readiness.watch()
            device.open()
            self.instance_id = attach.instance_id
            self._on_change()  # routes the instance's StepEvents here before any plan is sent
            self._session = self._sessions_opened = self._sessions_opened + 1  # set before any receipt can arrive
            self.engine.open_session(self._session, attach, device.send)
        except (grpc.RpcError, ValueError) as exc:
            detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)
            log.warning("cannot attach to device %s: %s", self.address, detail)
            self._detach((device, readiness))
            return None
        log.info("attached to device %s: %s (instance %s, %s, %d KV blocks)",
                 self.address, attach.model_name, attach.instance_id, attach.backend, attach.kv_num_blocks)
        self._on_change()
        return device, readiness

    def _watch(self) -> str | None:
        """Wait for the end of the session; the reason to fail its requests, or ``None`` when it was
        let go with no request left (already closed)."""
        while True:
            self._sleep(WATCH_PERIOD_S if self.accepting else DRAIN_POLL_S)
            if self._stop.is_set():
                return "prepare is shutting down"
            if self._lost_reason:
                return self._lost_reason
            overdue = self.engine.oldest_unpublished_step(self._session)
            if overdue is not None and overdue[1] > self._step_timeout_s:
                return f"reclaim published no events for step {overdue[0]} of device {self.address} within {self._step_timeout_s:g} s"
            if not self.accepting:
                why = "left the DNS answer" if not self._listed else "is draining"
                if self.engine.close_session_if_idle(self._session, f"device {self.address} {why}; no request was left on it"):
                    return None

    def _detach(self, links: tuple[DeviceLink, DeviceReadiness]) -> None:
        for link in links:
            link.close()
        was_known = self._session != 0 or self.instance_id
        self._session = 0
        self._device_ready = False
        self.instance_id = ""
        if was_known:
            self._on_change()

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    # ---- link callbacks (their reader threads) ------------------------------------------------------
    def _link_lost(self, reason: str) -> None:
        if not self._lost_reason:
            self._lost_reason = reason
            self._wake.set()

    def _readiness_changed(self, ready: bool) -> None:
        if ready != self._device_ready:
            self._device_ready = ready
            log.info("device %s readiness: %s", self.address, "SERVING" if ready else "NOT_SERVING (draining)")
            self._wake.set()
            self._on_change()

    def _receipt(self, receipt: device_pb2.StepReceipt) -> None:
        self.engine.on_receipt(self._session, receipt)
