"""Continuous batching for one device: requests in, step plans out, published events back to the
RPC handler of each request.

prepare has one engine per device endpoint, owned by that device's
:class:`~stageserve.prepare.session.DeviceSession` (which keeps it attached); the router
(``router.py``) places each request on one of them. The engine itself does no I/O: it is handed a
``send_plan`` function when attached, and is fed the device's receipts and reclaim's ``StepEvents``
(the in-process baseline, ``stageserve/bench/inprocess.py``, drives it without gRPC). Threads and
who calls what (everything shares one lock and condition):

- the step loop thread (:meth:`Engine._step_loop`): waits for a credit and work, schedules, sends;
- the device session's threads: :meth:`Engine.attach` / :meth:`Engine.detach`, and
  :meth:`Engine.on_receipt` (the ``Execute`` stream's reader);
- reclaim's reader thread (through the connector): :meth:`Engine.on_step_events`;
- the RPC handlers on prepare's gRPC event loop thread (through the router): :meth:`Engine.submit`,
  :meth:`Engine.abort`, :meth:`Engine.cancel`, figures; each request's events reach its handler
  through its :class:`~stageserve.prepare.request_handle.RequestHandle`.

An *attachment* is one attached device (while prepare is subscribed to reclaim); it has a fresh
:class:`~stageserve.prepare.scheduler.Scheduler` and ``SchedulerConfig.pipeline_depth`` credits (a
plan takes one; its publication or its refusal returns it; the scheduler's sliding-window bound
counts on them). When it ends, its requests go to ``resume`` (the router places them again:
``resumption.py``), or fail with ``UNAVAILABLE`` when there is none or prepare is stopping. Step
ids keep increasing from one attachment to the next, so a late receipt or ``StepEvents`` of an
earlier attachment matches no step sent and is dropped.

Every accepted request ends with exactly one terminal item on its ``RequestHandle``: its event
with a finish reason, or a :class:`RequestError`. :meth:`Engine._end` is the one place that
removes a request from the active set, so a second terminal is impossible.

Observability: the step loop records ``prepare.schedule`` / ``prepare.build_plan`` /
``prepare.send`` spans and the step's host time; :meth:`Engine.submit` begins a request's
``request.queue`` / ``request.ttft`` / ``request.total`` async spans (before the step loop can see
the request, so a begin always precedes its end) and the step loop ends ``request.queue``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
from prometheus_client import CollectorRegistry

from stageserve.prepare.errors import RequestError, invalid_argument, resource_exhausted, unavailable
from stageserve.prepare.metrics import PrepareMetrics, RequestObserver
from stageserve.prepare.placement import DeviceLoad
from stageserve.prepare.request_handle import RequestHandle
from stageserve.prepare.scheduled_step import ScheduledStep, build_step_plan, step_size_args
from stageserve.prepare.scheduler import AbortOutcome, Scheduler
from stageserve.prepare.scheduler_config import SchedulerConfig
from stageserve.prepare.validation import GenerationRequest, ModelLimits
from stageserve.tracing import Tracer, clock_ns
from stageserve.v1 import common_pb2, device_pb2, reclaim_pb2

log = logging.getLogger(__name__)

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]  # what reclaim fails a sequence of a lost device with: resumed
COMPILERS_BUSY_RETRY_S = 1.0  # Retry-After of a request whose grammar's compile did not get a device worker in time
NOT_ATTACHED = "prepare is not connected to the device and reclaim services; retry shortly"


@dataclass(eq=False)
class _Attachment:
    attach: device_pb2.AttachReply
    scheduler: Scheduler
    send_plan: Callable[[device_pb2.StepPlan], None]
    credits: int
    compile_constraint: Callable[..., None] | None = None  # ExecuteStream.compile_constraint's signature
    sent_at: dict[int, float] = field(default_factory=dict)  # unpublished step id -> time.monotonic() at send
    evictions_counted: int = 0  # the scheduler's prefix-cache evictions already added to the metric
    releases_counted: int = 0  # the scheduler's sliding-window releases already added to the metric


def local_abort_event(request: GenerationRequest) -> reclaim_pb2.SequenceEvent:
    """The terminal event of a request aborted before it reached the device (no tokens)."""
    return reclaim_pb2.SequenceEvent(
        request_id=request.request_id,
        finish_reason=common_pb2.FINISH_REASON_ABORT,
        prompt_tokens=request.num_prompt_tokens,
    )


class Engine:
    """Continuous batching over the current attachment; see the module docstring.

    Args:
        max_prefill_chunk: prompt tokens of one sequence per step at most (``--max-prefill-chunk``).
        max_waiting: waiting-queue bound (``--max-waiting``).
        tracer: prepare's tracer (default: one that never records).
        metrics: prepare's metrics (default: on a private registry nobody scrapes).
        enable_prefix_caching: share cached prompt blocks between requests (``--no-prefix-caching`` turns it off).
        resume: takes the requests of an attachment that ended, or that reclaim reported lost, with the
            reason (and this engine, when its attachment may still look healthy), to place them
            again (called without the engine's lock); ``None``: they fail.
    """

    def __init__(self, max_prefill_chunk: int, max_waiting: int, tracer: Tracer | None = None, metrics: PrepareMetrics | None = None,
                 enable_prefix_caching: bool = True, resume: Callable[..., None] | None = None) -> None:
        self._max_prefill_chunk = max_prefill_chunk
        self._resume = resume
        self._enable_prefix_caching = enable_prefix_caching
        self._max_waiting = max_waiting
        self._tracer = tracer or Tracer("prepare")
        self._metrics = metrics or PrepareMetrics(CollectorRegistry())
        self._cond = threading.Condition()
        self._attachment: _Attachment | None = None
        self._active: dict[str, RequestHandle] = {}
        self._compiling: dict[GenerationRequest, _Attachment] = {}  # active, its grammar compiling on that attachment's device
        self._stopping = False
        # Carried from one attachment to the next (see Scheduler's arguments).
        self._generations: list[int] = []
        self._next_step_id = 1
        self._last_instance_id = ""
        self._indices_in_use: list[int] = []
        self._thread = threading.Thread(target=self._step_loop, name="prepare-step-loop", daemon=True)

    # ---- the step loop ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the step loop (after :meth:`finish_active`)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _ready_to_step(self) -> bool:
        current = self._attachment
        return self._stopping or (current is not None and current.credits > 0 and current.scheduler.has_work())

    def _step_loop(self) -> None:
        tracer, observe_host_s = self._tracer, self._metrics.step_host.observe
        while True:
            with self._cond:
                # 1. wait for an attached device with a free credit and something to send
                self._cond.wait_for(self._ready_to_step)
                if self._stopping:
                    return
                current = self._attachment
                # 2. schedule the next step; it holds a credit until published or refused
                start_ns = clock_ns()
                with tracer.span("prepare.schedule") as span:
                    step = current.scheduler.schedule()
                    if step is not None and tracer.enabled:
                        span.set(**step_size_args(step))
                if step is None:  # has_work() promised a step; never spin on a broken promise
                    log.error("scheduler had work but built no step")
                    self._cond.wait(0.1)
                    continue
                current.credits -= 1
                current.sent_at[step.step_id] = time.monotonic()
                if step.started:
                    self._note_scheduled(step, start_ns)
                self._count_block_totals(current)
            # 3. build the plan (flat arrays) and send it; only this thread sends, so plans keep their order
            with tracer.span("prepare.build_plan", step_id=step.step_id):
                plan = build_step_plan(step)
            with tracer.span("prepare.send", step_id=step.step_id):
                current.send_plan(plan)
            observe_host_s((clock_ns() - start_ns) / 1e9)

    def _note_scheduled(self, step: ScheduledStep, now_ns: int) -> None:
        """The first rows of ``step.started`` were scheduled: their queue time ends (engine lock)."""
        observe_queue_s = self._metrics.queue_time.observe
        for seq in step.started:
            if self._enable_prefix_caching:
                self._metrics.prefix_cache_queries.inc(seq.request.num_prompt_tokens)
                self._metrics.prefix_cache_hits.inc(seq.num_cached_tokens)
            handle = self._active.get(seq.request.request_id)
            if handle is not None and handle.request is seq.request and handle.queued:
                handle.queued = False
                handle.cached_tokens = seq.num_cached_tokens
                observe_queue_s((now_ns - handle.accepted_ns) / 1e9)
                handle.observer.on_scheduled(now_ns)
                self._tracer.end_async("request.queue", seq.request.request_id, step_id=step.step_id, cached_tokens=seq.num_cached_tokens)

    def _count_block_totals(self, current: _Attachment) -> None:
        """Add the prefix-cache evictions and sliding-window releases of the step just scheduled to
        the metrics (engine lock)."""
        blocks = current.scheduler.block_manager
        evictions, releases = blocks.cache.num_evictions, blocks.num_window_released
        if evictions > current.evictions_counted:
            self._metrics.prefix_cache_evictions.inc(evictions - current.evictions_counted)
            current.evictions_counted = evictions
        if releases > current.releases_counted:
            self._metrics.kv_window_released.inc(releases - current.releases_counted)
            current.releases_counted = releases

    # ---- the attachment (driven by the device session) ---------------------------------------------
    def attach(self, reply: device_pb2.AttachReply, send_plan: Callable[[device_pb2.StepPlan], None],
               compile_constraint: Callable[..., None] | None = None) -> None:
        """Start scheduling for a freshly attached device (its ``AttachReply``); plans go to ``send_plan``,
        constraints to compile before their requests are scheduled to ``compile_constraint``
        (`ExecuteStream.compile_constraint`; ``None``: the device compiles each at its sequence's start).

        A device with the instance id of the previous attachment still holds that attachment's
        sequences: their indices are listed as ``finished`` in the first plan.

        Raises:
            ValueError: the ``AttachReply`` describes an unusable device (no KV blocks, no sequences).
        """
        if min(reply.max_num_seqs, reply.max_step_tokens, reply.kv_num_blocks, reply.kv_block_size, reply.max_model_len) < 1:
            raise ValueError(f"the device reported unusable limits: {reply}")
        config = SchedulerConfig.from_attach(reply, self._max_prefill_chunk, self._max_waiting, self._enable_prefix_caching)
        with self._cond:
            stale = self._indices_in_use if reply.instance_id == self._last_instance_id else ()
            scheduler = Scheduler(config, self._generations, stale, first_step_id=self._next_step_id)
            self._attachment = _Attachment(reply, scheduler, send_plan, credits=config.pipeline_depth,
                                           compile_constraint=compile_constraint)
            self._cond.notify_all()

    def detach(self, reason: str, resume: bool = False) -> None:
        """End the attachment, if any: with ``resume`` (and a ``resume`` callback) its requests go to
        be placed again, else they fail with ``UNAVAILABLE`` naming ``reason``."""
        orphans: list[RequestHandle] = []
        with self._cond:
            current = self._attachment
            if current is None:
                return
            scheduler = current.scheduler
            self._generations, self._next_step_id = scheduler.generations, scheduler.next_step_id
            self._last_instance_id, self._indices_in_use = current.attach.instance_id, scheduler.seq_indices_in_use
            self._attachment = None
            self._compiling.clear()  # their handles are active: resumed or failed below
            error = unavailable(f"{reason}; the request did not finish, retry it")
            for handle in list(self._active.values()):
                if resume and self._resume is not None:
                    del self._active[handle.request.request_id]  # no terminal: it goes on elsewhere
                    orphans.append(handle)
                else:
                    self._end(handle, error)
            self._cond.notify_all()
            log.warning("device %s detached (%s)", current.attach.instance_id, reason)
        if orphans:
            self._resume(orphans, reason)

    def detach_if_idle(self, reason: str) -> bool:
        """:meth:`detach` if no request is active (a draining device is let go); whether it did.

        Atomic with :meth:`submit`, so a request accepted meanwhile keeps the device attached.
        """
        with self._cond:
            if self._active:
                return False
            self.detach(reason)
            return True

    def oldest_unpublished_step(self) -> tuple[int, float] | None:
        """``(step_id, seconds since sent)`` of the oldest step sent and not yet published, if any."""
        with self._cond:
            current = self._attachment
            if current is None or not current.sent_at:
                return None
            step_id = min(current.sent_at)
            return step_id, time.monotonic() - current.sent_at[step_id]

    def on_receipt(self, receipt: device_pb2.StepReceipt) -> None:
        """A device receipt; a refused plan fails the requests with rows in it (``INTERNAL``)."""
        if not receipt.error:
            return
        with self._cond:
            current = self._attachment
            if current is None or current.sent_at.pop(receipt.step_id, None) is None:
                return  # not a step of this attachment
            log.error("device refused step %d: %s", receipt.step_id, receipt.error)
            error = RequestError(grpc.StatusCode.INTERNAL, f"the device refused step {receipt.step_id}: {receipt.error}")
            for request in current.scheduler.fail_step(receipt.step_id):
                self._end_request(request, error)
            current.credits += 1
            self._cond.notify_all()

    def on_step_events(self, step_events: reclaim_pb2.StepEvents) -> None:
        """One step published by reclaim: update the scheduler, route its events, return the credit.
        A sequence reclaim fails with ``UNAVAILABLE`` (its device's stream is gone, or its step's
        output never came) goes to ``resume`` like those of a detached device."""
        orphans: list[RequestHandle] = []
        reason = ""
        with self._cond:
            current = self._attachment
            if current is None or step_events.device_instance_id not in ("", current.attach.instance_id):
                return
            if current.sent_at.pop(step_events.step_id, None) is None:
                return  # not a step of this attachment (another subscriber's, or an earlier attachment's)
            for request, event in current.scheduler.update_from_output(step_events):
                if event.error_code:
                    handle = self._active.get(request.request_id)
                    if event.error_code != _UNAVAILABLE or self._resume is None or handle is None or handle.request is not request:
                        self._end_request(request, RequestError.from_wire(event.error_code, event.error_message))
                    else:
                        del self._active[request.request_id]  # no terminal: it goes on elsewhere
                        orphans.append(handle)
                        reason = reason or event.error_message
                elif event.finish_reason:
                    self._end_request(request, event)
                elif (handle := self._active.get(request.request_id)) is not None and handle.request is request:
                    handle.put(event)
            current.credits += 1
            self._cond.notify_all()
        if orphans:
            self._resume(orphans, reason, self)  # this device's session may not know yet

    # ---- requests (RPC handlers) -------------------------------------------------------------------
    def model_limits(self) -> ModelLimits:
        """The attached model's vocabulary and context sizes.

        Raises:
            RequestError: ``UNAVAILABLE`` while no device is attached.
        """
        with self._cond:
            attach = self._require_attachment().attach
            return ModelLimits(attach.vocab_size, attach.max_model_len)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Accept a validated request; its outcomes arrive on the returned handle.

        Raises:
            RequestError: ``UNAVAILABLE`` (not attached), ``ALREADY_EXISTS`` (its id is
                active), ``RESOURCE_EXHAUSTED`` (queue full, or it can never fit the KV cache).
        """
        with self._cond:
            accepted_ns = clock_ns()
            handle = RequestHandle(request, RequestObserver(self._metrics, self._tracer, request.request_id, accepted_ns), accepted_ns)
            self._queue(request, handle)
            self._metrics.prompt_tokens.inc(request.num_prompt_tokens)
            if self._tracer.enabled:
                for name in ("request.queue", "request.ttft", "request.total"):
                    self._tracer.begin_async(name, request.request_id, prompt_tokens=request.num_prompt_tokens)
            return handle

    @property
    def attachment(self) -> object:
        """The current attachment (``None`` while detached): identity tells one attachment from the next."""
        return self._attachment

    def adopt(self, request: GenerationRequest, handle: RequestHandle) -> None:
        """Accept ``request``, which resumes ``handle``'s request (its device failed), onto that handle.

        Raises:
            RequestError: as :meth:`submit`.
        """
        with self._cond:
            self._queue(request, handle)  # its queue time and first schedule were observed on the first device
            handle.request = request

    def _queue(self, request: GenerationRequest, handle: RequestHandle) -> None:
        """Queue ``request`` in the scheduler as ``handle``'s (engine lock); a constrained request
        once the device has compiled its grammar, so that no step waits for a compile. Raises
        RequestError as :meth:`submit`."""
        current = self._require_attachment()
        if request.request_id in self._active:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.request_id!r} is already running; use another id")
        if request.constraint is not None and current.compile_constraint is not None:
            current.scheduler.check_request(request)
            self._compiling[request] = current
            self._active[request.request_id] = handle
            current.compile_constraint(request.constraint, request.tenant, lambda call: self._compiled(request, current, call))
            return
        current.scheduler.add_request(request)
        self._active[request.request_id] = handle
        self._cond.notify_all()

    def _compiled(self, request: GenerationRequest, attachment: _Attachment, call: grpc.Future) -> None:
        """The device's ``CompileConstraint`` for ``request`` ended: queue it, or end it with the
        device's refusal. A device without the RPC, or failing, compiles at the sequence's start."""
        error = call.exception()
        refusal = None
        if error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT:
            refusal = invalid_argument(error.details())
        elif error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            refusal = resource_exhausted(error.details(), reason="GRAMMAR_COMPILERS_BUSY", retry_after_s=COMPILERS_BUSY_RETRY_S)
        with self._cond:
            if self._compiling.get(request) is not attachment:
                return  # aborted meanwhile, or its device detached (the request was resumed or failed)
            del self._compiling[request]
            handle = self._active[request.request_id]
            if refusal is None:
                try:
                    attachment.scheduler.add_request(request)
                except RequestError as exc:
                    refusal = exc
            if refusal is not None:
                self._end(handle, refusal)
            self._cond.notify_all()

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is active here."""
        return request_id in self._active

    def owns(self, handle: RequestHandle) -> bool:
        """Whether ``handle`` is an active request of this engine."""
        return self._active.get(handle.request.request_id) is handle

    def abort(self, request_id: str) -> bool:
        """Abort the active request ``request_id`` (the Abort RPC); ``False`` if none is active."""
        with self._cond:
            handle = self._active.get(request_id)
            if handle is None:
                return False
            self._abort(handle)
            return True

    def cancel(self, handle: RequestHandle) -> None:
        """The RPC of ``handle`` ended (client cancel, disconnect, deadline, or normal end): abort
        the request if it still runs, and stop its handler from waiting."""
        with self._cond:
            if self._active.get(handle.request.request_id) is handle:
                self._abort(handle)
        handle.client_gone()

    def _abort(self, handle: RequestHandle) -> None:
        if self._compiling.pop(handle.request, None) is not None:
            self._end(handle, local_abort_event(handle.request))
            return
        current = self._attachment
        outcome = current.scheduler.abort(handle.request) if current is not None else AbortOutcome.NOT_FOUND
        if outcome is AbortOutcome.REMOVED_WAITING:
            self._end(handle, local_abort_event(handle.request))
        elif outcome is AbortOutcome.FORWARDED:
            self._cond.notify_all()  # the abort rides in the next plan, an empty one if need be

    def _require_attachment(self) -> _Attachment:
        if self._attachment is None:
            raise unavailable(NOT_ATTACHED)
        return self._attachment

    def _end_request(self, request: GenerationRequest, item: reclaim_pb2.SequenceEvent | RequestError) -> None:
        handle = self._active.get(request.request_id)
        if handle is not None and handle.request is request:
            self._end(handle, item)

    def _end(self, handle: RequestHandle, item: reclaim_pb2.SequenceEvent | RequestError) -> None:
        """Deliver the terminal ``item`` of an active request (the only place a request leaves the active set)."""
        del self._active[handle.request.request_id]
        if handle.queued:  # never scheduled: its queue span ends with it
            self._tracer.end_async("request.queue", handle.request.request_id, scheduled=False)
        handle.put(item)
        self._cond.notify_all()

    # ---- figures and shutdown ----------------------------------------------------------------------
    def current_load(self) -> DeviceLoad | None:
        """The current load, or ``None`` while no device is attached."""
        with self._cond:
            current = self._attachment
            if current is None:
                return None
            scheduler = current.scheduler
            blocks = scheduler.block_manager
            return DeviceLoad(current.attach, scheduler.num_running, scheduler.num_waiting, blocks.num_free, blocks.num_blocks,
                              blocks.num_available, scheduler.num_waiting_kv_blocks, blocks.cache.num_cached)

    def prefix_hit_tokens(self, request: GenerationRequest) -> int:
        """Prompt tokens of ``request`` this device's prefix cache holds now (0 while detached)."""
        with self._cond:
            current = self._attachment
            if current is None:
                return 0
            return len(current.scheduler.prefix_hit(request)) * current.attach.kv_block_size

    def finish_active(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the active requests to end; those still running then fail
        with ``UNAVAILABLE``. (Refusing new ones while draining is the router's job.)"""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._active, timeout=timeout_s):
                error = unavailable(f"the server shut down before the request finished (drain timeout {timeout_s:g} s); retry it")
                for handle in list(self._active.values()):
                    self._end(handle, error)
