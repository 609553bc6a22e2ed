"""One device endpoint as prepare serves it: a :class:`DeviceSession`.

A session owns everything prepare keeps for one device: its
:class:`~stageserve.prepare.engine.Engine` (scheduler, KV block bookkeeping, credits, step loop),
its ``Execute`` stream (:class:`~stageserve.prepare.streams.ExecuteStream`: plans out, receipts
of refused plans in), its readiness watch (:class:`~stageserve.prepare.streams.DeviceReadiness`) and the thread
that keeps them up, reconnecting with
:class:`~stageserve.backoff.Backoff`:

1. wait until reclaim is subscribed (the connector says so);
2. dial until the device is ready (health SERVING) and answers ``Attach``; open the ``Execute``
   stream and attach the engine to it;
3. watch until the ``Execute`` stream breaks, reclaim is lost, a sent step is not published within
   ``--step-timeout``, or the session no longer accepts (the device turned NOT_SERVING: it drains;
   or its address left the DNS answer) and no request is left on it. Meanwhile a sent step not
   published within ``--stall-timeout`` (shorter), from a device that does not answer a health
   Check within that time either, marks the device *stalled*: it takes no new requests (prepare's
   readiness drops when no other device accepts) until its steps complete again or it answers. A
   device that is only slow (a long prefill, a busy CPU) answers, since its compute releases the
   GIL to the gRPC threads: it is not stalled (sglang#22511 is what a fixed timeout does to a loaded pod);
   a stopped or hung process does not;
4. detach: requests still on the device fail with ``UNAVAILABLE`` (none when it was let go idle);
   then dial again (1.), unless the address left the DNS answer: then the thread ends and the
   connector drops the session.

A session *accepts* new requests only while attached, ready, not stalled and listed. A request placed on it
stays on it until it ends: a draining device keeps its ``Execute`` stream until its last request
finished, and its drain waits for prepare to let it go.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import grpc

from stageserve.backoff import Backoff
from stageserve.prepare.engine import Engine
from stageserve.prepare.streams import HEALTH_CHECK_TIMEOUT_S, DeviceReadiness, ExecuteStream
from stageserve.security.tls import TlsFiles, dial
from stageserve.server import GRPC_OPTIONS

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 0.5  # how often an accepting session looks for an overdue step
STABLE_ATTACHMENT_S = 5.0  # an attachment that lasts this long resets the backoff
DRAIN_POLL_S = 0.1    # how often a session that no longer accepts looks whether its last request ended


class _NotAttached(Exception):
    """An attempt to attach failed; ``level``: how loud its log line is."""

    def __init__(self, reason: str, level: int = logging.WARNING) -> None:
        super().__init__(reason)
        self.level = level


class DeviceSession:
    """One device endpoint's engine, streams and reconnection (see the module docstring).

    Args:
        address: the device's ``HOST:PORT``.
        engine: the device's engine (started by the session, stopped by :meth:`stop`).
        reclaim_up: set while prepare is subscribed to reclaim.
        on_change: called (no arguments) when the session attaches, detaches, or its readiness flips.
        step_timeout_s: a sent step not published within this time ends the attachment.
        stall_timeout_s: a sent step not published within this time, from a device that does not
            answer a health Check within it either, marks the device stalled (default: never, before
            ``step_timeout_s`` ends the attachment).
        tls: the TLS files the device is dialled with (``None``: plaintext).
    """

    def __init__(self, address: str, engine: Engine, reclaim_up: threading.Event, on_change: Callable[[], None],
                 step_timeout_s: float, stall_timeout_s: float | None = None, tls: TlsFiles | None = None) -> None:
        self.address = address
        self.engine = engine
        self.instance_id = ""  # of the attached device; "" while detached
        self._channel = dial(address, tls, GRPC_OPTIONS)
        self._reclaim_up, self._on_change, self._step_timeout_s = reclaim_up, on_change, step_timeout_s
        self._stall_timeout_s = step_timeout_s if stall_timeout_s is None else stall_timeout_s
        self.stalled = ""  # why the attached device counts as stalled; "" while it is not
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._listed = True
        self._attached = False
        self._device_ready = False
        self._lost_reason = ""
        self._thread = threading.Thread(target=self._run, name=f"prepare-session-{address}", daemon=True)

    # ---- state, read by the connector and the router ---------------------------------------------
    @property
    def attached(self) -> bool:
        return self._attached

    @property
    def accepting(self) -> bool:
        """Whether new requests may be placed here: attached, the device ready and not stalled, the address listed."""
        return self._attached and self._device_ready and self._listed and not self.stalled

    @property
    def finished(self) -> bool:
        """The session's thread ended (its address left the DNS answer and its device is let go)."""
        return self._thread.ident is not None and not self._thread.is_alive()

    # ---- control (connector) ------------------------------------------------------------------------
    def start(self) -> None:
        self.engine.start()
        self._thread.start()

    def stop(self) -> None:
        """Detach (requests still on the device fail with ``UNAVAILABLE``), stop the engine, close the channel."""
        self._stop.set()
        self._wake.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=10)
        self.engine.stop()
        self._channel.close()

    def set_listed(self, listed: bool) -> None:
        """The address is (still) in the DNS answer, or left it: then no new requests, and the
        thread ends once the device is let go."""
        if listed != self._listed:
            self._listed = listed
            self._wake.set()

    def wake(self) -> None:
        """Look at the state now (reclaim came up)."""
        self._wake.set()

    def reclaim_lost(self, reason: str) -> None:
        """reclaim's stream is gone: detach (the device's events would never arrive)."""
        if self._attached:
            self._stream_lost(reason)

    # ---- the session's thread -----------------------------------------------------------------------
    def _run(self) -> None:
        backoff = Backoff(log, f"device {self.address}")
        while not self._stop.is_set() and self._listed:
            # 1. reclaim first: steps sent before the subscription would be published to nobody
            if not self._reclaim_up.is_set():
                self._sleep(WATCH_PERIOD_S)
                continue
            # 2. dial until the device is ready and attached
            try:
                streams = self._attach()
            except _NotAttached as refusal:
                self._sleep(backoff.refused(str(refusal), refusal.level))
                continue
            # 3. watch; 4. detach
            attached_at = time.monotonic()
            reason = self._watch(streams[1])
            if reason is not None:
                self.engine.detach(reason, resume=not self._stop.is_set())  # its requests go on elsewhere
            self._detach(streams)
            # An attachment lost at once (the device takes Attach but drops the stream) is a refusal
            # too: retried with backoff, not in a tight loop.
            if reason is not None and time.monotonic() - attached_at < STABLE_ATTACHMENT_S and not self._stop.is_set():
                self._sleep(backoff.refused(f"attachment lost within {STABLE_ATTACHMENT_S:g} s ({reason})"))
            else:
                backoff.succeeded()

    def _attach(self) -> tuple[ExecuteStream, DeviceReadiness]:
        """Attach the engine to the device over a new ``Execute`` stream.

        Raises:
            _NotAttached: the device is not ready, did not answer, or reported unusable limits.
        """
        stream = ExecuteStream(self._channel, self.engine.on_receipt, self._stream_lost)
        readiness = DeviceReadiness(self._channel, self._readiness_changed)
        try:
            if not readiness.check():
                raise _NotAttached("not ready (health NOT_SERVING: loading, or draining)", logging.INFO)
            reply = stream.attach()
            self._lost_reason = ""
            self._device_ready = True
            readiness.watch()
            stream.open()
            self.instance_id = reply.instance_id
            self._on_change()  # routes the instance's StepEvents here before any plan is sent
            self._attached = True  # before any plan: a reclaim lost from now on ends this attachment
            self.engine.attach(reply, stream.send, stream.compile_constraint)
        except (grpc.RpcError, ValueError, _NotAttached) as exc:
            self._detach((stream, readiness))
            if isinstance(exc, _NotAttached):
                raise
            detail = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)
            raise _NotAttached(f"cannot attach ({detail})") from exc
        log.info("attached to device %s: %s (instance %s, %s, %d KV blocks)",
                 self.address, reply.model_name, reply.instance_id, reply.backend, reply.kv_num_blocks)
        self._on_change()
        return stream, readiness

    def _watch(self, readiness: DeviceReadiness) -> str | None:
        """Wait for the end of the attachment; the reason to fail its requests, or ``None`` when the
        device was let go with no request left (the engine is already detached)."""
        while True:
            self._sleep(min(WATCH_PERIOD_S, self._stall_timeout_s / 4) if self.accepting else DRAIN_POLL_S)
            if self._stop.is_set():
                return "prepare is shutting down"
            if self._lost_reason:
                return self._lost_reason
            if not self._reclaim_up.is_set():  # lost while this attachment was being made (too early for reclaim_lost)
                return "reclaim's Subscribe stream was lost"
            overdue = self.engine.oldest_unpublished_step()
            if overdue is not None and overdue[1] > self._step_timeout_s:
                return f"reclaim published no events for step {overdue[0]} of device {self.address} within {self._step_timeout_s:g} s"
            self._note_stall(overdue, readiness)
            if not (self._device_ready and self._listed):
                why = "left the DNS answer" if not self._listed else "is draining"
                if self.engine.detach_if_idle(f"device {self.address} {why}; no request was left on it"):
                    return None

    def _note_stall(self, overdue: tuple[int, float] | None, readiness: DeviceReadiness) -> None:
        """Mark the device stalled while its oldest unpublished step is older than the stall
        timeout and it does not answer a health Check within that time, and not once either
        changes (its steps complete again, or it answers); log and notify each change."""
        stalled = overdue is not None and overdue[1] > self._stall_timeout_s and not self._answers(readiness)
        if stalled == bool(self.stalled):
            return
        if stalled:
            self.stalled = (f"device {self.address} is stalled: step {overdue[0]} sent {overdue[1]:.1f} s ago is not completed"
                            f" and the device does not answer health Checks (--stall-timeout {self._stall_timeout_s:g} s)")
            log.warning("%s; no new requests go to it until it completes steps again", self.stalled)
        else:
            self.stalled = ""
            log.warning("device %s completes steps again; it takes new requests", self.address)
        self._on_change()

    def _answers(self, readiness: DeviceReadiness) -> bool:
        """Whether the device answers a health Check within the stall timeout (whatever its status)."""
        try:
            readiness.check(min(HEALTH_CHECK_TIMEOUT_S, self._stall_timeout_s))
        except grpc.RpcError:
            return False
        return True

    def _detach(self, streams: tuple[ExecuteStream, DeviceReadiness]) -> None:
        for stream in streams:
            stream.close()
        was_known = self._attached or self.instance_id
        self._attached = False
        self._device_ready = False
        self.stalled = ""
        self.instance_id = ""
        if was_known:
            self._on_change()

    def _sleep(self, seconds: float) -> None:
        self._wake.wait(seconds)
        self._wake.clear()

    # ---- stream callbacks (their reader threads) ----------------------------------------------------
    def _stream_lost(self, reason: str) -> None:
        if not self._lost_reason:
            self._lost_reason = reason
            self._wake.set()

    def _readiness_changed(self, ready: bool) -> None:
        if ready != self._device_ready:
            self._device_ready = ready
            log.info("device %s readiness: %s", self.address, "SERVING" if ready else "NOT_SERVING (draining)")
            self._wake.set()
            self._on_change()

