"""Keeps prepare connected: one reclaim subscription, one device session per device endpoint.

- **reclaim**: one ``Subscribe`` stream (:class:`~stageserve.prepare.streams.ReclaimSubscription`),
  dialled with :class:`~stageserve.backoff.Backoff`. Its ``StepEvents`` go to the engine of the
  device that ran the step (``device_instance_id`` → engine; step ids are per engine). When it
  breaks, every session detaches its device (their requests fail with ``UNAVAILABLE``: their
  events would never arrive) and waits for the next subscription.
- **devices**: an :class:`~stageserve.device_endpoints.EndpointFollower` resolves ``--device``
  every ``--device-refresh-s`` seconds. A new address gets a
  :class:`~stageserve.prepare.session.DeviceSession`; an address that left stops getting new
  requests and its session ends once its requests are done; an address that comes back gets a
  session again. No restart of prepare (or reclaim) is needed.
- **readiness** (``on_ready``): SERVING while reclaim is subscribed and at least one session
  accepts requests.
"""

from __future__ import annotations

import logging
import socket
import threading
from typing import Callable

import grpc

from stageserve.backoff import Backoff
from stageserve.device_endpoints import DeviceEndpoints, EndpointFollower, Resolver
from stageserve.prepare.engine import Engine
from stageserve.prepare.session import DeviceSession
from stageserve.prepare.streams import ReclaimSubscription
from stageserve.security.tls import TlsFiles, dial
from stageserve.server import GRPC_OPTIONS
from stageserve.v1 import reclaim_pb2

log = logging.getLogger(__name__)


class PipelineConnector:
    """reclaim subscription, device sessions, event routing and readiness (see the module docstring).

    Args:
        endpoints: the parsed ``--device``.
        reclaim_target: ``HOST:PORT`` of reclaim.
        new_engine: builds the engine of a new device session.
        on_ready: called with the new readiness whenever it changes.
        step_timeout_s: a sent step not published within this time detaches its device.
        stall_timeout_s: a sent step not published within this time marks its device stalled (no new requests).
        refresh_s: seconds between DNS lookups of ``dns:///`` entries.
        resolver: ``socket.getaddrinfo`` or a stand-in (tests).
        tls: the TLS files reclaim and the devices are dialled with (``None``: plaintext).
    """

    def __init__(self, endpoints: DeviceEndpoints, reclaim_target: str, new_engine: Callable[[], Engine],
                 on_ready: Callable[[bool], None], step_timeout_s: float, refresh_s: float,
                 resolver: Resolver = socket.getaddrinfo, stall_timeout_s: float | None = None, tls: TlsFiles | None = None) -> None:
        self._tls = tls
        self._reclaim_channel = dial(reclaim_target, tls, GRPC_OPTIONS)
        self._reclaim_target = reclaim_target
        self._new_engine, self._on_ready, self._step_timeout_s = new_engine, on_ready, step_timeout_s
        self._stall_timeout_s = stall_timeout_s
        self._lock = threading.RLock()
        self._sessions: dict[str, DeviceSession] = {}
        self._engines_by_instance: dict[str, Engine] = {}  # replaced whole, read without the lock
        self._ready: bool | None = None
        self._reclaim_up = threading.Event()
        self._reclaim_lost = threading.Event()
        self._reclaim_lost_reason = ""
        self._stop = threading.Event()
        self._follower = EndpointFollower(endpoints, refresh_s, self._update_sessions, resolver)
        self._thread = threading.Thread(target=self._run_reclaim, name="prepare-reclaim-connector", daemon=True)

    def sessions(self) -> list[DeviceSession]:
        """The current device sessions (a snapshot)."""
        with self._lock:
            return list(self._sessions.values())

    def start(self) -> None:
        self._thread.start()
        self._follower.start()

    def stop(self) -> None:
        """Stop following, end every session (requests still on a device fail) and the subscription."""
        self._stop.set()
        self._reclaim_lost.set()
        self._follower.stop()
        self._thread.join(timeout=10)
        for session in self.sessions():
            session.stop()
        self._reclaim_channel.close()

    # ---- devices ----------------------------------------------------------------------------------
    def _update_sessions(self, addresses: tuple[str, ...]) -> None:
        """The follower's current address set: add sessions, let go of those that left."""
        if self._stop.is_set():
            return
        listed = set(addresses)
        with self._lock:
            for address, session in list(self._sessions.items()):
                if address in listed and not session.finished:
                    session.set_listed(True)
                    continue
                session.set_listed(False)
                if session.finished:
                    session.stop()
                    del self._sessions[address]
            for address in addresses:
                if address not in self._sessions:
                    session = DeviceSession(address, self._new_engine(), self._reclaim_up, self._session_changed, self._step_timeout_s,
                                            self._stall_timeout_s, tls=self._tls)
                    self._sessions[address] = session
                    session.start()
        self._session_changed()

    def _session_changed(self) -> None:
        """Recompute the event routing and the readiness (any thread)."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._engines_by_instance = {session.instance_id: session.engine for session in sessions if session.instance_id}
            ready = self._reclaim_up.is_set() and any(session.accepting for session in sessions)
            if ready != self._ready:
                self._ready = ready
                self._on_ready(ready)

    # ---- reclaim ----------------------------------------------------------------------------------
    def _run_reclaim(self) -> None:
        backoff = Backoff(log, f"reclaim {self._reclaim_target}")
        while not self._stop.is_set():
            # 1. subscribe (with backoff)
            self._reclaim_lost.clear()
            subscription = ReclaimSubscription(self._reclaim_channel, self._route_step_events, self._subscription_lost)
            try:
                subscription.open()
            except grpc.RpcError as exc:
                subscription.close()
                self._stop.wait(backoff.refused(f"cannot subscribe ({exc.code().name}: {exc.details()})"))
                continue
            backoff.succeeded()
            log.info("subscribed to reclaim %s", self._reclaim_target)
            # 2. let the sessions attach, and wait until the stream is lost (or prepare stops)
            self._reclaim_up.set()
            for session in self.sessions():
                session.wake()
            self._session_changed()
            self._reclaim_lost.wait()
            # 3. every session detaches: their steps would be published to nobody
            self._reclaim_up.clear()
            self._session_changed()
            reason = "prepare is shutting down" if self._stop.is_set() else self._reclaim_lost_reason
            for session in self.sessions():
                session.reclaim_lost(reason)
            subscription.close()

    def _subscription_lost(self, reason: str) -> None:
        if not self._reclaim_lost.is_set():
            self._reclaim_lost_reason = reason
            self._reclaim_lost.set()

    def _route_step_events(self, step_events: reclaim_pb2.StepEvents) -> None:
        """One published step, to the engine of the device that ran it (reclaim's reader thread)."""
        engine = self._engines_by_instance.get(step_events.device_instance_id)
        if engine is not None:
            engine.on_step_events(step_events)

