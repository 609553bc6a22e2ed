"""Keeps prepare connected: one reclaim subscription, one lane per device endpoint.

- **reclaim**: one ``Subscribe`` stream, dialled with exponential backoff. Its ``StepEvents`` are
  routed to the lane of the device that ran the step (``device_instance_id`` → lane; step ids are
  per lane). When it breaks, every lane ends its session (their requests fail with
  ``UNAVAILABLE``: their events would never arrive) and waits for the next subscription.
- **devices**: an :class:`~stageserve.device_endpoints.EndpointFollower` resolves ``--device``
  every ``--device-refresh-s`` seconds. A new address gets a lane (``lanes.py``); an address that
  left stops getting new requests and its lane ends once its requests are done; an address that
  comes back gets a lane again. No restart of prepare (or reclaim) is needed.
- **readiness** (``on_ready``): SERVING while reclaim is subscribed and at least one lane accepts
  requests.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable

import grpc

from stageserve.device_endpoints import DeviceEndpoints, EndpointFollower, Resolver
from stageserve.prepare.engine import Engine
from stageserve.prepare.lanes import BACKOFF_INITIAL_S, BACKOFF_MAX_S, DeviceLane
from stageserve.prepare.links import ReclaimLink
from stageserve.server import GRPC_OPTIONS
from stageserve.v1 import reclaim_pb2

log = logging.getLogger(__name__)


class PipelineConnector:
    """reclaim subscription, device lanes, event routing and readiness (see the module docstring).

    Args:
        endpoints: the parsed ``--device``.
        reclaim_target: ``HOST:PORT`` of reclaim.
        new_engine: builds the engine of a new lane.
        on_ready: called with the new readiness whenever it changes.
        step_timeout_s: a sent step not published within this time ends its lane's session.
        refresh_s: seconds between DNS lookups of ``dns:///`` entries.
        resolver: ``socket.getaddrinfo`` or a stand-in (tests).
    """

    def __init__(self, endpoints: DeviceEndpoints, reclaim_target: str, new_engine: Callable[[], Engine],
                 on_ready: Callable[[bool], None], step_timeout_s: float, refresh_s: float,
                 resolver: Resolver = socket.getaddrinfo) -> None:
        self._reclaim_channel = grpc.insecure_channel(reclaim_target, options=GRPC_OPTIONS)
        self._reclaim_target = reclaim_target
        self._new_engine, self._on_ready, self._step_timeout_s = new_engine, on_ready, step_timeout_s
        self._lock = threading.RLock()
        self._lanes: dict[str, DeviceLane] = {}
        self._by_instance: dict[str, DeviceLane] = {}  # replaced whole, read without the lock
        self._ready: bool | None = None
        self._reclaim_up = threading.Event()
        self._reclaim_lost = threading.Event()
        self._reclaim_lost_reason = ""
        self._stop = threading.Event()
        self._follower = EndpointFollower(endpoints, refresh_s, self._update_lanes, resolver)
        self._thread = threading.Thread(target=self._run_reclaim, name="prepare-reclaim-connector", daemon=True)

    def lanes(self) -> list[DeviceLane]:
        """The current lanes (a snapshot)."""
        with self._lock:
            return list(self._lanes.values())

    def start(self) -> None:
        self._thread.start()
        self._follower.start()

    def stop(self) -> None:
        """Stop following, end every lane (requests still in one fail) and the subscription."""
        self._stop.set()
        self._reclaim_lost.set()
        self._follower.stop()
        self._thread.join(timeout=10)
        for lane in self.lanes():
            lane.stop()
        self._reclaim_channel.close()

    # ---- devices ----------------------------------------------------------------------------------
    def _update_lanes(self, addresses: tuple[str, ...]) -> None:
        """The follower's current address set: add lanes, let go of those that left."""
        if self._stop.is_set():
            return
        listed = set(addresses)
        with self._lock:
            for address, lane in list(self._lanes.items()):
                if address in listed and not lane.finished:
                    lane.set_listed(True)
                    continue
                lane.set_listed(False)
                if lane.finished:
                    lane.stop()
                    del self._lanes[address]
            for address in addresses:
                if address not in self._lanes:
                    lane = DeviceLane(address, self._new_engine(), self._reclaim_up, self._lane_changed, self._step_timeout_s)
                    self._lanes[address] = lane
                    lane.start()
        self._lane_changed()

    def _lane_changed(self) -> None:
        """Recompute the event routing and the readiness (any thread)."""
        with self._lock:
            lanes = list(self._lanes.values())
            self._by_instance = {lane.instance_id: lane for lane in lanes if lane.instance_id}
            ready = self._reclaim_up.is_set() and any(lane.accepting for lane in lanes)
            if ready != self._ready:
                self._ready = ready
                self._on_ready(ready)

    # ---- reclaim ----------------------------------------------------------------------------------
    def _run_reclaim(self) -> None:
        delay = BACKOFF_INITIAL_S
        while not self._stop.is_set():
            # 1. subscribe (with backoff)
            self._reclaim_lost.clear()
            link = ReclaimLink(self._reclaim_channel, self._step_events, self._link_lost)
            try:
                link.open()
            except grpc.RpcError as exc:
                log.warning("cannot subscribe to reclaim %s (%s: %s); retrying in %.1f s",
                            self._reclaim_target, exc.code().name, exc.details(), delay)
                link.close()
                self._stop.wait(delay)
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            delay = BACKOFF_INITIAL_S
            log.info("subscribed to reclaim %s", self._reclaim_target)
            # 2. let the lanes attach, and wait until the stream is lost (or prepare stops)
            self._reclaim_up.set()
            for lane in self.lanes():
                lane.wake()
            self._lane_changed()
            self._reclaim_lost.wait()
            # 3. every lane's session ends: their steps would be published to nobody
            self._reclaim_up.clear()
            self._lane_changed()
            reason = "prepare is shutting down" if self._stop.is_set() else self._reclaim_lost_reason
            for lane in self.lanes():
                lane.reclaim_lost(reason)
            link.close()

    def _link_lost(self, reason: str) -> None:
        if not self._reclaim_lost.is_set():
            self._reclaim_lost_reason = reason
            self._reclaim_lost.set()

    def _step_events(self, step_events: reclaim_pb2.StepEvents) -> None:
        lane = self._by_instance.get(step_events.device_instance_id)
        if lane is not None:
            lane.on_step_events(step_events)
