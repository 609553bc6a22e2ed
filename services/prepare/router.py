"""The public API's view of the devices: places each new request on one lane and finds it again.

Each device has its own engine (``lanes.py``). The router is the one object the RPC handlers talk
to: it checks that a request id is not active on any lane, places the request by
:func:`~stageserve.prepare.placement.placement_order` over the lanes that accept requests (trying
the next one when a lane refuses it: queue full, pool too small, or it just detached), forwards
Abort and client cancels to the lane that holds the request, sums the figures, and drains them all
on shutdown. Lock order: router, then an engine (an engine never calls the router).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc

from stageserve.prepare.engine import EngineLoad, RequestHandle
from stageserve.prepare.errors import RequestError, unavailable
from stageserve.prepare.lanes import DeviceLane
from stageserve.prepare.metrics import PrepareMetrics
from stageserve.prepare.placement import placement_order
from stageserve.prepare.validation import GenerationRequest, ModelLimits

NOT_CONNECTED = "prepare is not connected to a ready device and to reclaim; retry shortly"


@dataclass(frozen=True)
class DeviceFigures:
    """One lane for ``GetModelInfo``: where it dials, whether it takes requests, its load (``None`` while detached)."""

    address: str
    instance_id: str
    attached: bool
    accepting: bool
    load: EngineLoad | None


class DeviceRouter:
    """Places requests on lanes (see the module docstring).

    Args:
        lanes: returns the current lanes (the connector's :meth:`~stageserve.prepare.connector.PipelineConnector.lanes`).
        metrics: prepare's metrics (the API counts refused requests there).
    """

    def __init__(self, lanes: Callable[[], Sequence[DeviceLane]], metrics: PrepareMetrics) -> None:
        self._lanes = lanes
        self._metrics = metrics
        self._lock = threading.Lock()
        self._draining = False

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def metrics(self) -> PrepareMetrics:
        return self._metrics

    # ---- requests ---------------------------------------------------------------------------------
    def model_limits(self) -> ModelLimits:
        """Vocabulary and context limits every attached device can serve (the smallest context).

        Raises:
            RequestError: ``UNAVAILABLE`` while draining or while no device is attached.
        """
        if self._draining:
            raise unavailable("server is draining; retry on another replica")
        loads = [load for lane in self._lanes() if lane.accepting and (load := lane.engine.current_load()) is not None]
        if not loads:
            raise unavailable(NOT_CONNECTED)
        return ModelLimits(loads[0].attach.vocab_size, min(load.attach.max_model_len for load in loads))

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Accept ``request`` on the least loaded accepting lane; it stays there until it ends.

        Raises:
            RequestError: ``UNAVAILABLE`` (draining, or no lane accepts), ``ALREADY_EXISTS`` (its id
                is active on some lane), or the last lane's refusal (``RESOURCE_EXHAUSTED``: queue
                full or the request can never fit a KV pool).
        """
        with self._lock:
            if self._draining:
                raise unavailable("server is draining; retry on another replica")
            lanes = self._lanes()
            if any(lane.engine.has_request(request.request_id) for lane in lanes):
                raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.request_id!r} is already running; use another id")
            candidates = [(lane, load) for lane in lanes if lane.accepting and (load := lane.engine.current_load()) is not None]
            refusal = unavailable(NOT_CONNECTED)
            for index in placement_order([load.lane_load for _, load in candidates]):
                try:
                    return candidates[index][0].engine.submit(request)
                except RequestError as error:  # try the next lane; report the most telling refusal
                    if refusal.code == grpc.StatusCode.UNAVAILABLE:
                        refusal = error
            raise refusal

    def abort(self, request_id: str) -> bool:
        """Abort the active request ``request_id`` on whichever lane holds it; ``False`` if none does."""
        return any(lane.engine.abort(request_id) for lane in self._lanes())

    def cancel(self, handle: RequestHandle) -> None:
        """The RPC of ``handle`` ended: abort the request on its lane if it still runs; stop its handler waiting."""
        for lane in self._lanes():
            if lane.engine.owns(handle):
                lane.engine.cancel(handle)
                return
        handle.client_gone()

    # ---- figures and shutdown -----------------------------------------------------------------------
    def devices(self) -> list[DeviceFigures]:
        """Every lane's figures, by address."""
        return [DeviceFigures(lane.address, lane.instance_id, lane.attached, lane.accepting, lane.engine.current_load())
                for lane in sorted(self._lanes(), key=lambda lane: lane.address)]

    def load(self) -> tuple[EngineLoad, list[DeviceFigures]]:
        """The totals over the attached lanes (model facts of one of them) and every lane's figures.

        Raises:
            RequestError: ``UNAVAILABLE`` while no device is attached.
        """
        devices = self.devices()
        total = sum_loads([device.load for device in devices if device.load is not None])
        if total is None:
            raise unavailable(NOT_CONNECTED)
        return total, devices

    def current_load(self) -> EngineLoad | None:
        """The totals, or ``None`` while no device is attached (for the metrics gauges)."""
        return sum_loads([load for lane in self._lanes() if (load := lane.engine.current_load()) is not None])

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests (``UNAVAILABLE``) and wait up to ``timeout_s`` in all for the active
        ones on every lane; those still running then fail with ``UNAVAILABLE``."""
        with self._lock:
            self._draining = True
        deadline = time.monotonic() + timeout_s
        for lane in self._lanes():
            lane.engine.drain(max(0.0, deadline - time.monotonic()))


def sum_loads(loads: Sequence[EngineLoad]) -> EngineLoad | None:
    """One :class:`EngineLoad` with the figures of ``loads`` added up (model facts of the first); ``None`` for none."""
    if not loads:
        return None
    return EngineLoad(
        loads[0].attach,
        running=sum(load.running for load in loads),
        waiting=sum(load.waiting for load in loads),
        kv_blocks_free=sum(load.kv_blocks_free for load in loads),
        kv_blocks_total=sum(load.kv_blocks_total for load in loads),
        kv_blocks_available=sum(load.kv_blocks_available for load in loads),
        waiting_kv_blocks=sum(load.waiting_kv_blocks for load in loads),
    )
