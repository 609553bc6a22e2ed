"""The public API's view of the devices: places each new request on one device and finds it again.

Each device has its own session and engine (``session.py``, ``engine.py``). The router is the one
object the RPC handlers talk to: it checks that a request id is not active on any device, places
the request by :func:`~stageserve.prepare.placement.placement_order` over the loads of the
sessions that accept requests and the prefix of the request each one's cache holds (trying the
next one when an engine refuses it: queue full, pool too small, or it just detached), forwards
Abort and client cancels to the engine that holds the request (an Abort for an id no engine holds
yet is remembered: :mod:`~stageserve.prepare.early_aborts`), places again the requests of a device
that failed (:meth:`DeviceRouter.resume`, ``resumption.py``: on another device, or the same one
once it is back, within ``RESUME_TIMEOUT_S``), sums the figures, and drains on shutdown: it alone
refuses new requests then. Lock order: router, then an engine (an engine calls the router only
without its lock: :meth:`DeviceRouter.resume`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable, Sequence

import grpc

from stageserve.logs import REQUEST_ID
from stageserve.prepare.early_aborts import EarlyAborts
from stageserve.prepare.engine import Engine, local_abort_event
from stageserve.prepare.errors import RequestError, unavailable
from stageserve.prepare.metrics import PrepareMetrics
from stageserve.prepare.placement import DeviceLoad, placement_order, sum_loads
from stageserve.prepare.request_handle import RequestHandle
from stageserve.prepare.resumption import RESUME_TIMEOUT_S
from stageserve.prepare.session import DeviceSession
from stageserve.prepare.validation import GenerationRequest, ModelLimits, client_request_id

log = logging.getLogger(__name__)

NOT_CONNECTED = "prepare is not connected to a ready device and to reclaim; retry shortly"
DRAINING = "server is draining; retry on another replica"
NO_DEVICE_RETRY_S = 1.0  # RetryInfo while no device accepts: a reconnect or a stalled device's recovery takes about that
DRAINING_RETRY_S = 0.5  # RetryInfo: another replica takes it now; this one is gone soon
RESUME_POLL_S = 0.1  # how often requests waiting to be resumed look for a device that accepts


@dataclass(frozen=True)
class _Resuming:
    """A request waiting to be resumed: the request that resumes it (`Resumption.resumed_request`:
    no event arrives while it waits, so it stays right), until when, why, and the engine it failed
    on (with the attachment it failed in) that it does not go back to."""

    request: GenerationRequest
    deadline: float  # time.monotonic()
    reason: str
    failed: Engine | None
    failed_attachment: object

    def avoids(self, engine: Engine) -> bool:
        """Whether ``engine`` is the failed one, still in the attachment the request failed in."""
        return engine is self.failed and engine.attachment is self.failed_attachment


def _accepting(sessions: Sequence[DeviceSession]) -> list[tuple[DeviceSession, DeviceLoad]]:
    """The sessions that take new requests, each with its engine's load."""
    return [(session, load) for session in sessions if session.accepting and (load := session.engine.current_load()) is not None]


@dataclass(frozen=True)
class DeviceFigures:
    """One device for ``GetModelInfo``: where prepare dials it, whether it takes requests, its load (``None`` while detached)."""

    address: str
    instance_id: str
    attached: bool
    accepting: bool
    load: DeviceLoad | None
    stalled: bool = False


def no_device_refusal(sessions: Sequence[DeviceSession]) -> RequestError:
    """``UNAVAILABLE`` for a request no device accepts: naming the stalled devices if any (reason
    ``DEVICE_STALLED``), else ``NOT_CONNECTED``; both say to retry in a second."""
    stalled = [session.stalled for session in sessions if session.stalled]
    if stalled:
        return unavailable("; ".join(stalled) + "; retry shortly", reason="DEVICE_STALLED", retry_after_s=NO_DEVICE_RETRY_S)
    return unavailable(NOT_CONNECTED, retry_after_s=NO_DEVICE_RETRY_S)


class DeviceRouter:
    """Places requests on devices (see the module docstring).

    Args:
        sessions: returns the current device sessions (the connector's
            :meth:`~stageserve.prepare.connector.PipelineConnector.sessions`).
        metrics: prepare's metrics (the API counts refused requests there).
        stop_requested: whether the process was asked to stop (SIGTERM): from then on it refuses
            like a drain, before :meth:`drain` is called (the signal's waiter sees it only within
            its poll, and a request admitted meanwhile would run into the drain).
    """

    def __init__(self, sessions: Callable[[], Sequence[DeviceSession]], metrics: PrepareMetrics,
                 stop_requested: Callable[[], bool] = lambda: False) -> None:
        self._sessions = sessions
        self._metrics = metrics
        self._stop_requested = stop_requested
        self._lock = threading.Lock()
        self._draining = False
        self._early_aborts = EarlyAborts()
        self._resuming: dict[RequestHandle, _Resuming] = {}  # requests no device took back yet
        self._resumer: threading.Thread | None = None

    @property
    def draining(self) -> bool:
        return self._draining or self._stop_requested()

    @property
    def metrics(self) -> PrepareMetrics:
        return self._metrics

    # ---- requests ---------------------------------------------------------------------------------
    def model_limits(self) -> ModelLimits:
        """Vocabulary and context limits every attached device can serve (the smallest context).

        Raises:
            RequestError: ``UNAVAILABLE`` while draining or while no device is attached.
        """
        if self.draining:
            raise unavailable(DRAINING, reason="DRAINING", retry_after_s=DRAINING_RETRY_S)
        sessions = self._sessions()
        loads = [load for _, load in _accepting(sessions)]
        if not loads:
            raise no_device_refusal(sessions)
        return ModelLimits(loads[0].attach.vocab_size, min(load.attach.max_model_len for load in loads))

    def submit(self, request: GenerationRequest, caller: str = "", abort_key: str | None = None) -> RequestHandle:
        """Accept ``request`` on the accepting device placement prefers; it stays there until it ends.
        If ``caller`` aborted ``abort_key`` (default: its id; a choice's: its request's) shortly
        before (:meth:`abort`), it ends at once with ``finish_reason`` abort.

        Raises:
            RequestError: ``UNAVAILABLE`` (draining, or no device accepts), ``ALREADY_EXISTS`` (its
                id is active on some device), or the last device's refusal (``RESOURCE_EXHAUSTED``:
                queue full or the request can never fit a KV pool).
        """
        with self._lock:
            if self.draining:
                raise unavailable(DRAINING, reason="DRAINING", retry_after_s=DRAINING_RETRY_S)
            sessions = self._sessions()
            if (any(session.engine.has_request(request.request_id) for session in sessions)
                    or any(handle.request.request_id == request.request_id for handle in self._resuming)):
                shown = client_request_id(request.request_id)
                raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {shown!r} is already running; use another id")
            candidates = _accepting(sessions)
            refusal = no_device_refusal(sessions)
            hits = [session.engine.prefix_hit_tokens(request) for session, _ in candidates] if len(candidates) > 1 else []
            for index in placement_order([load for _, load in candidates], hits):
                engine = candidates[index][0].engine
                try:
                    handle = engine.submit(request)
                except RequestError as error:  # try the next device; report the most telling refusal
                    if refusal.code == grpc.StatusCode.UNAVAILABLE:
                        refusal = error
                    continue
                if self._early_aborts.take(caller, abort_key or request.request_id):
                    engine.abort(request.request_id)  # still waiting: it ends now, with finish_reason abort
                return handle
            raise refusal

    def abort(self, request_ids: Sequence[str], caller: str = "") -> bool:
        """Abort every active request of ``request_ids`` (a request id and its choices' ids) on
        whichever device holds it; ``False`` if none runs: then an abort by ``caller`` of the first id
        is kept for a request that registers shortly after."""
        with self._lock:
            sessions = self._sessions()
            aborted = [session.engine.abort(request_id) for request_id in request_ids for session in sessions]  # a list: abort every one
            waiting = [handle for handle in self._resuming if handle.request.request_id in request_ids]
            for handle in waiting:
                del self._resuming[handle]
                handle.put(local_abort_event(handle.request))
            if any(aborted) or waiting:
                return True
            self._early_aborts.remember(caller, request_ids[0])
            return False

    def cancel(self, handle: RequestHandle) -> None:
        """The RPC of ``handle`` ended: abort the request on its device if it still runs; stop its handler waiting."""
        with self._lock:
            self._resuming.pop(handle, None)
        for session in self._sessions():
            if session.engine.owns(handle):
                session.engine.cancel(handle)
                return
        handle.client_gone()

    # ---- recovery -----------------------------------------------------------------------------------
    def resume(self, handles: list[RequestHandle], reason: str, failed: Engine | None = None) -> None:
        """Place again the requests of a device that failed for ``reason`` (``resumption.py``): each
        goes on on an accepting device now, or as soon as one accepts, within ``RESUME_TIMEOUT_S``;
        one that times out or meets a drain fails with ``UNAVAILABLE`` naming ``reason``.
        ``failed``: the failed device's engine when its session may not know yet (reclaim reported
        it first): it is not tried again until it attaches anew. An engine calls this without its lock."""
        deadline, failed_attachment = time.monotonic() + RESUME_TIMEOUT_S, failed.attachment if failed is not None else None
        with self._lock:
            for handle in handles:
                if self.draining:
                    handle.put(unavailable(f"{reason}; the server is draining, so the request was not resumed: retry it",
                                           reason="DRAINING", retry_after_s=DRAINING_RETRY_S))
                else:
                    self._resuming[handle] = _Resuming(handle.resumption.resumed_request(), deadline, reason, failed, failed_attachment)
            self._place_resuming()
            if self._resuming and (self._resumer is None or not self._resumer.is_alive()):
                self._resumer = threading.Thread(target=self._keep_resuming, name="prepare-resumer", daemon=True)
                self._resumer.start()

    def _keep_resuming(self) -> None:
        """Place the waiting resumed requests as devices come to accept; fail those past their deadline."""
        while True:
            time.sleep(RESUME_POLL_S)
            with self._lock:
                now = time.monotonic()
                for handle, waiting in list(self._resuming.items()):
                    if now > waiting.deadline or self.draining:
                        del self._resuming[handle]
                        handle.put(unavailable(f"{waiting.reason}; no device took the request back within {RESUME_TIMEOUT_S:g} s:"
                                               " retry it", retry_after_s=NO_DEVICE_RETRY_S))
                self._place_resuming()
                if not self._resuming:
                    return

    def _place_resuming(self) -> None:
        """Place each waiting resumed request on the accepting device placement prefers (router lock)."""
        accepting = _accepting(self._sessions())
        for handle, waiting in list(self._resuming.items()):
            candidates = [(session, load) for session, load in accepting if not waiting.avoids(session.engine)]
            resumption, request = handle.resumption, waiting.request
            for index in placement_order([load for _, load in candidates], []):
                session = candidates[index][0]
                try:
                    session.engine.adopt(request, handle)
                except RequestError:
                    continue
                del self._resuming[handle]
                log.info("resumed on device %s after: %s (%d output tokens kept, %d regenerated; %d prompt tokens to prefill)",
                         session.address, waiting.reason, resumption.settled, len(resumption.generated) - resumption.settled,
                         request.num_prompt_tokens, extra={REQUEST_ID: request.request_id})
                break

    # ---- figures and shutdown -----------------------------------------------------------------------
    def devices(self) -> list[DeviceFigures]:
        """Every device's figures, by address."""
        return [DeviceFigures(session.address, session.instance_id, session.attached, session.accepting, session.engine.current_load(),
                              bool(session.stalled))
                for session in sorted(self._sessions(), key=lambda session: session.address)]

    def load(self) -> tuple[DeviceLoad, list[DeviceFigures]]:
        """The totals over the attached devices (model facts of one of them) and every device's figures.

        Raises:
            RequestError: ``UNAVAILABLE`` while no device is attached.
        """
        devices = self.devices()
        total = sum_loads([device.load for device in devices if device.load is not None])
        if total is None:
            raise unavailable(NOT_CONNECTED)
        return total, devices

    def current_load(self) -> DeviceLoad | None:
        """The totals, or ``None`` while no device is attached (for the metrics gauges)."""
        return sum_loads([load for session in self._sessions() if (load := session.engine.current_load()) is not None])

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests (``UNAVAILABLE``) and wait up to ``timeout_s`` in all for the active
        ones on every device; those still running then fail with ``UNAVAILABLE``."""
        with self._lock:
            self._draining = True
        deadline = time.monotonic() + timeout_s
        for session in self._sessions():
            session.engine.finish_active(max(0.0, deadline - time.monotonic()))

