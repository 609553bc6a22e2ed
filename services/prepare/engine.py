"""The step loop of one device: ties its scheduler to the device (plans out, receipts in) and to
reclaim (published ``StepEvents`` in), and routes each request's events to the RPC that waits for it.

prepare runs one engine per device endpoint (a *lane*, ``lanes.py``); the router (``router.py``)
places each request on one of them. Threads and who calls what (everything shares one lock and condition):

- the step loop thread (:meth:`Engine._run`): waits for a credit and work, schedules, sends;
- the links' reader threads: :meth:`Engine.on_receipt`, :meth:`Engine.on_step_events`;
- the lane (``lanes.py``): :meth:`Engine.open_session` / :meth:`Engine.close_session`;
- the RPC handlers on prepare's gRPC event loop thread (through the router): :meth:`Engine.submit`,
  :meth:`Engine.abort`, :meth:`Engine.cancel`, figures; each request's events reach its handler
  through its :class:`RequestHandle`.

A *session* is one attached device plus one reclaim subscription; it owns a fresh
:class:`~stageserve.prepare.scheduler.Scheduler` and ``pipeline_depth`` credits (a plan takes one;
its publication or its refusal returns it). When either peer goes away the session ends and every
request in it fails with ``UNAVAILABLE``.

Every accepted request ends with exactly one terminal item on its :class:`RequestHandle`: its
event with a finish reason, or a :class:`RequestError`. :meth:`Engine._end` is the one place that
removes a request from the active set, so a second terminal is impossible.

Observability: the step loop records ``prepare.schedule`` / ``prepare.build_plan`` /
``prepare.send`` spans and the step's host time; :meth:`Engine.submit` begins a request's
``request.queue`` / ``request.ttft`` / ``request.total`` async spans (before the step loop can see
the request, so a begin always precedes its end) and the step loop ends ``request.queue``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry

from stageserve.prepare.errors import RequestError, unavailable
from stageserve.prepare.metrics import PrepareMetrics, RequestObserver
from stageserve.prepare.placement import LaneLoad
from stageserve.prepare.scheduler import PLACEHOLDER_TOKEN, AbortOutcome, ScheduledStep, Scheduler, SchedulerConfig
from stageserve.prepare.validation import GenerationRequest, ModelLimits
from stageserve.tracing import Tracer, clock_ns
from stageserve.v1 import common_pb2, device_pb2, reclaim_pb2

log = logging.getLogger(__name__)

_CLIENT_GONE = object()  # handle sentinel: the RPC ended on the client's side, stop waiting


class LoopWaker:
    """Resolves futures of one event loop from any thread, with one wake-up of the loop per burst.

    A ``loop.call_soon_threadsafe`` per future would write the loop's self-pipe once per stream
    and step (a syscall, and a chance for the GIL to pass to the loop thread mid-burst); reclaim's
    reader thread routes a step's events to all of its streams in one go, so the futures it
    resolves share one wake-up.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._due: list[asyncio.Future] = []

    def wake(self, future: asyncio.Future) -> None:
        """Resolve ``future`` (to ``None``) on the loop soon; any thread, the loop's included."""
        with self._lock:
            self._due.append(future)
            first = len(self._due) == 1
        if first:
            try:
                self.loop.call_soon_threadsafe(self._resolve)
            except RuntimeError:  # the loop is closed: its consumers are gone with it
                pass

    def _resolve(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for future in due:
            if not future.done():  # a cancelled consumer leaves its future behind
                future.set_result(None)


class RequestHandle:
    """One accepted request's outcomes, in order, for the RPC handler that serves it.

    The engine's threads :meth:`put` items; one consumer takes them, with :meth:`events` on a
    thread (the in-process baseline) or :meth:`events_async` on an event loop (prepare's gRPC
    handlers). A consumer that finds nothing arms a one-shot wake-up, so a :meth:`put` wakes it
    only when it waits, and several items that arrive meanwhile are taken in one go.

    Attributes:
        request: the validated request.
        observer: its metrics and ``request.*`` trace events, fed by the RPC handler.
        accepted_ns: ``clock_ns()`` at acceptance.
        queued: no row of it has been scheduled yet (engine lock).
    """

    def __init__(self, request: GenerationRequest, observer: RequestObserver, accepted_ns: int) -> None:
        self.request = request
        self.observer = observer
        self.accepted_ns = accepted_ns
        self.queued = True
        self._lock = threading.Lock()
        self._items: deque = deque()
        self._wake: Callable[[], None] | None = None  # armed by a waiting consumer, fired by the next put

    def put(self, item: reclaim_pb2.SequenceEvent | RequestError) -> None:
        """Deliver ``item`` (an event, or the terminal error) and wake the consumer if it waits; any thread."""
        with self._lock:
            self._items.append(item)
            wake, self._wake = self._wake, None
        if wake is not None:
            wake()

    def client_gone(self) -> None:
        """Wake the handler: the client cancelled, disconnected or hit its deadline."""
        self.put(_CLIENT_GONE)

    def events(self) -> Iterator[reclaim_pb2.SequenceEvent]:
        """Yield the request's events up to and including the one with a finish reason, blocking
        the calling thread while none is there.

        Ends early (without error) once the client is gone.

        Raises:
            RequestError: the request ended with this gRPC status instead.
        """
        ready = threading.Event()
        for event in self._events_or_waits(ready.set):
            if event is None:
                ready.wait()
                ready.clear()  # fired once per arming: no set can be lost here
            else:
                yield event

    async def events_async(self, waker: LoopWaker) -> AsyncIterator[reclaim_pb2.SequenceEvent]:
        """:meth:`events` for a coroutine on ``waker``'s loop: awaits while none is there.

        Raises:
            RequestError: the request ended with this gRPC status instead.
        """
        ready = waker.loop.create_future()
        # The wake-up reads ``ready`` when a put fires it: the future being awaited, since a new one
        # is made only after that one resolved, and armed only after that.
        for event in self._events_or_waits(lambda: waker.wake(ready)):
            if event is None:
                await ready
                ready = waker.loop.create_future()
            else:
                yield event

    def _events_or_waits(self, wake: Callable[[], None]) -> Iterator[reclaim_pb2.SequenceEvent | None]:
        """The request's events in order up to its end, with ``None`` each time none is there and
        ``wake`` is armed for the next :meth:`put`: the consumer then waits for ``wake`` and resumes.

        Raises:
            RequestError: the request ended with this gRPC status instead.
        """
        while True:
            with self._lock:
                items = self._items
                if items:
                    self._items = deque()
                else:
                    self._wake = wake
            if not items:
                yield None
                continue
            for item in items:
                if (event := _event(item)) is None:
                    return
                yield event
                if event.finish_reason:
                    return


def _event(item: reclaim_pb2.SequenceEvent | RequestError | object) -> reclaim_pb2.SequenceEvent | None:
    """The event ``item`` is; ``None`` for the client-gone mark.

    Raises:
        RequestError: ``item`` is the request's terminal error.
    """
    if item is _CLIENT_GONE:
        return None
    if isinstance(item, RequestError):
        raise item
    return item


@dataclass(frozen=True)
class EngineLoad:
    """Current figures for ``GetModelInfo`` and placement (blocks: KV blocks; free = holding no
    sequence's KV; available = free and not reserved by a running sequence)."""

    attach: device_pb2.AttachReply
    running: int
    waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    kv_blocks_available: int = 0
    waiting_kv_blocks: int = 0

    @property
    def lane_load(self) -> LaneLoad:
        """What placement weighs."""
        return LaneLoad(self.kv_blocks_available, self.waiting_kv_blocks, self.waiting, self.running)


@dataclass(eq=False)
class _Session:
    number: int
    attach: device_pb2.AttachReply
    scheduler: Scheduler
    send_plan: Callable[[device_pb2.StepPlan], None]
    credits: int
    sent_at: dict[int, float] = field(default_factory=dict)  # unpublished step id -> time.monotonic() at send


def build_step_plan(step: ScheduledStep) -> device_pb2.StepPlan:
    """The wire form of a scheduled step: flat repeated fields; one ``SequenceStart`` per new sequence only."""
    return device_pb2.StepPlan(
        step_id=step.step_id,
        started=[
            common_pb2.SequenceStart(
                seq_index=seq.seq_index,
                generation=seq.generation,
                request_id=seq.request.request_id,
                sampling=seq.request.sampling,
                stop=seq.request.stop,
                prompt_token_ids=seq.request.prompt_token_ids,
            )
            for seq in step.started
        ],
        finished=step.finished,
        seq_index=step.seq_index,
        generation=step.generation,
        start_pos=step.start_pos,
        num_tokens=step.num_tokens,
        token_ids=step.token_ids,
        sample=step.sample,
        num_new_blocks=step.num_new_blocks,
        new_block_ids=step.new_block_ids,
        aborted=step.aborted,
    )


def step_size_args(step: ScheduledStep) -> dict[str, int]:
    """Trace args of a step's size: rows, prompt tokens and decode tokens (decode rows carry the placeholder)."""
    decode = step.token_ids.count(PLACEHOLDER_TOKEN)
    return {"step_id": step.step_id, "batch_size": len(step.rows), "prefill_tokens": len(step.token_ids) - decode, "decode_tokens": decode}


def local_abort_event(request: GenerationRequest) -> reclaim_pb2.SequenceEvent:
    """The terminal event of a request aborted before it reached the device (no tokens)."""
    return reclaim_pb2.SequenceEvent(
        request_id=request.request_id,
        finish_reason=common_pb2.FINISH_REASON_ABORT,
        prompt_tokens=request.num_prompt_tokens,
    )


class Engine:
    """Continuous batching over the current session; see the module docstring.

    Args:
        max_prefill_chunk: prompt tokens of one sequence per step at most (``--max-prefill-chunk``).
        max_waiting: waiting-queue bound (``--max-waiting``).
        tracer: prepare's tracer (default: one that never records).
        metrics: prepare's metrics (default: on a private registry nobody scrapes).
    """

    def __init__(self, max_prefill_chunk: int, max_waiting: int, tracer: Tracer | None = None, metrics: PrepareMetrics | None = None) -> None:
        self._max_prefill_chunk = max_prefill_chunk
        self._max_waiting = max_waiting
        self._tracer = tracer or Tracer("prepare")
        self._metrics = metrics or PrepareMetrics(CollectorRegistry())
        self._cond = threading.Condition()
        self._session: _Session | None = None
        self._active: dict[str, RequestHandle] = {}
        self._draining = False
        self._stopping = False
        # Carried from one session to the next (see Scheduler's arguments).
        self._generations: list[int] = []
        self._next_step_id = 1
        self._last_instance_id = ""
        self._indices_in_use: list[int] = []
        self._thread = threading.Thread(target=self._run, name="prepare-step-loop", daemon=True)

    # ---- the step loop ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the step loop (after :meth:`drain`)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    def _ready_to_step(self) -> bool:
        session = self._session
        return self._stopping or (session is not None and session.credits > 0 and session.scheduler.has_work())

    def _run(self) -> None:
        tracer, observe_host_s = self._tracer, self._metrics.step_host.observe
        while True:
            with self._cond:
                # 1. wait for a session with a free credit and something to send
                self._cond.wait_for(self._ready_to_step)
                if self._stopping:
                    return
                session = self._session
                # 2. schedule the next step; it holds a credit until published or refused
                start_ns = clock_ns()
                with tracer.span("prepare.schedule") as span:
                    step = session.scheduler.schedule()
                    if step is not None and tracer.enabled:
                        span.set(**step_size_args(step))
                if step is None:  # has_work() promised a step; never spin on a broken promise
                    log.error("scheduler had work but built no step")
                    self._cond.wait(0.1)
                    continue
                session.credits -= 1
                session.sent_at[step.step_id] = time.monotonic()
                if step.started:
                    self._note_scheduled(step, start_ns)
            # 3. build the plan (flat arrays) and send it; only this thread sends, so plans keep their order
            with tracer.span("prepare.build_plan", step_id=step.step_id):
                plan = build_step_plan(step)
            with tracer.span("prepare.send", step_id=step.step_id):
                session.send_plan(plan)
            observe_host_s((clock_ns() - start_ns) / 1e9)

    def _note_scheduled(self, step: ScheduledStep, now_ns: int) -> None:
        """The first rows of ``step.started`` were scheduled: their queue time ends (engine lock)."""
        observe_queue_s = self._metrics.queue_time.observe
        for seq in step.started:
            handle = self._active.get(seq.request.request_id)
            if handle is not None and handle.request is seq.request and handle.queued:
                handle.queued = False
                observe_queue_s((now_ns - handle.accepted_ns) / 1e9)
                handle.observer.on_scheduled(now_ns)
                self._tracer.end_async("request.queue", seq.request.request_id, step_id=step.step_id)

    # ---- the session (driven by the connector) --------------------------------------------------
    def open_session(self, number: int, attach: device_pb2.AttachReply, send_plan: Callable[[device_pb2.StepPlan], None]) -> None:
        """Start session ``number`` (chosen by the caller, increasing) on a freshly attached device.

        A device with the instance id of the previous session still holds that session's sequences:
        their indices are listed as ``finished`` in the first plan.

        Raises:
            ValueError: the ``AttachReply`` describes an unusable device (no KV blocks, no sequences).
        """
        if min(attach.max_num_seqs, attach.max_step_tokens, attach.kv_num_blocks, attach.kv_block_size, attach.max_model_len) < 1:
            raise ValueError(f"the device reported unusable limits: {attach}")
        config = SchedulerConfig.from_attach(attach, self._max_prefill_chunk, self._max_waiting)
        with self._cond:
            stale = self._indices_in_use if attach.instance_id == self._last_instance_id else ()
            scheduler = Scheduler(config, self._generations, stale, first_step_id=self._next_step_id)
            self._session = _Session(number, attach, scheduler, send_plan, credits=max(1, attach.pipeline_depth))
            self._cond.notify_all()

    def close_session(self, number: int, reason: str) -> None:
        """End session ``number``: every request in it fails with ``UNAVAILABLE`` naming ``reason``."""
        with self._cond:
            session = self._session
            if session is None or session.number != number:
                return
            scheduler = session.scheduler
            self._generations, self._next_step_id = scheduler.generations, scheduler.next_step_id
            self._last_instance_id, self._indices_in_use = session.attach.instance_id, scheduler.seq_indices_in_use
            self._session = None
            error = unavailable(f"{reason}; the request did not finish, retry it")
            for handle in list(self._active.values()):
                self._end(handle, error)
            log.warning("session %d closed (%s)", number, reason)

    def close_session_if_idle(self, number: int, reason: str) -> bool:
        """End session ``number`` if no request is active (a draining device is let go); whether it ended.

        Atomic with :meth:`submit`, so a request accepted meanwhile keeps the session open.
        """
        with self._cond:
            if self._active:
                return False
            self.close_session(number, reason)
            return True

    def oldest_unpublished_step(self, number: int) -> tuple[int, float] | None:
        """``(step_id, seconds since sent)`` of session ``number``'s oldest unpublished step, if any."""
        with self._cond:
            session = self._session
            if session is None or session.number != number or not session.sent_at:
                return None
            step_id = min(session.sent_at)
            return step_id, time.monotonic() - session.sent_at[step_id]

    def on_receipt(self, number: int, receipt: device_pb2.StepReceipt) -> None:
        """A device receipt; a refused plan fails the requests with rows in it (``INTERNAL``)."""
        if not receipt.error:
            return
        with self._cond:
            session = self._current(number)
            if session is None or session.sent_at.pop(receipt.step_id, None) is None:
                return
            log.error("device refused step %d: %s", receipt.step_id, receipt.error)
            error = RequestError(grpc.StatusCode.INTERNAL, f"the device refused step {receipt.step_id}: {receipt.error}")
            for request in session.scheduler.fail_step(receipt.step_id):
                self._end_request(request, error)
            session.credits += 1
            self._cond.notify_all()

    def on_step_events(self, number: int, step_events: reclaim_pb2.StepEvents) -> None:
        """One step published by reclaim: update the scheduler, route its events, return the credit."""
        with self._cond:
            session = self._current(number)
            if session is None or step_events.device_instance_id not in ("", session.attach.instance_id):
                return
            if session.sent_at.pop(step_events.step_id, None) is None:
                return  # not a step of this session (another subscriber's, or an older session's)
            for request, event in session.scheduler.update_from_output(step_events):
                if event.error_code:
                    self._end_request(request, RequestError.from_wire(event.error_code, event.error_message))
                elif event.finish_reason:
                    self._end_request(request, event)
                elif (handle := self._active.get(request.request_id)) is not None and handle.request is request:
                    handle.put(event)
            session.credits += 1
            self._cond.notify_all()

    def _current(self, number: int) -> _Session | None:
        session = self._session
        return session if session is not None and session.number == number else None

    # ---- requests (RPC handlers) -------------------------------------------------------------------
    def model_limits(self) -> ModelLimits:
        """The attached model's vocabulary and context sizes.

        Raises:
            RequestError: ``UNAVAILABLE`` while draining or while no device is attached.
        """
        with self._cond:
            attach = self._require_session().attach
            return ModelLimits(attach.vocab_size, attach.max_model_len)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Accept a validated request; its outcomes arrive on the returned handle.

        Raises:
            RequestError: ``UNAVAILABLE`` (draining, or not connected), ``ALREADY_EXISTS`` (its id is
                active), ``RESOURCE_EXHAUSTED`` (queue full, or it can never fit the KV cache).
        """
        with self._cond:
            session = self._require_session()
            if request.request_id in self._active:
                raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.request_id!r} is already running; use another id")
            session.scheduler.add_request(request)
            accepted_ns = clock_ns()
            handle = RequestHandle(request, RequestObserver(self._metrics, self._tracer, request.request_id, accepted_ns), accepted_ns)
            self._active[request.request_id] = handle
            self._metrics.prompt_tokens.inc(request.num_prompt_tokens)
            if self._tracer.enabled:
                for name in ("request.queue", "request.ttft", "request.total"):
                    self._tracer.begin_async(name, request.request_id, prompt_tokens=request.num_prompt_tokens)
            self._cond.notify_all()
            return handle

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is active here."""
        return request_id in self._active

    def owns(self, handle: RequestHandle) -> bool:
        """Whether ``handle`` is an active request of this engine."""
        return self._active.get(handle.request.request_id) is handle

    @property
    def num_active(self) -> int:
        """Accepted requests without their terminal message yet."""
        return len(self._active)

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
        session = self._session
        outcome = session.scheduler.abort(handle.request) if session is not None else AbortOutcome.NOT_FOUND
        if outcome is AbortOutcome.REMOVED_WAITING:
            self._end(handle, local_abort_event(handle.request))
        elif outcome is AbortOutcome.FORWARDED:
            self._cond.notify_all()  # the abort rides in the next plan, an empty one if need be

    def _require_session(self) -> _Session:
        if self._draining:
            raise unavailable("server is draining; retry on another replica")
        if self._session is None:
            raise unavailable("prepare is not connected to the device and reclaim services; retry shortly")
        return self._session

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
    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def metrics(self) -> PrepareMetrics:
        """prepare's metrics (the API layer counts refused requests there)."""
        return self._metrics

    def load(self) -> EngineLoad:
        """The attached device's facts and the current load.

        Raises:
            RequestError: ``UNAVAILABLE`` while no device is attached.
        """
        load = self.current_load()
        if load is None:
            raise unavailable("prepare is not connected to the device and reclaim services; retry shortly")
        return load

    def current_load(self) -> EngineLoad | None:
        """The current load, or ``None`` while no device is attached (for the metrics gauges)."""
        with self._cond:
            session = self._session
            if session is None:
                return None
            scheduler = session.scheduler
            blocks = scheduler.block_manager
            return EngineLoad(session.attach, scheduler.num_running, scheduler.num_waiting, blocks.num_free, blocks.num_blocks,
                              blocks.num_available, scheduler.num_waiting_kv_blocks)

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests (``UNAVAILABLE``) and wait up to ``timeout_s`` for the active ones;
        those still running then fail with ``UNAVAILABLE``."""
        with self._cond:
            self._draining = True
            if not self._cond.wait_for(lambda: not self._active, timeout=timeout_s):
                error = unavailable(f"the server shut down before the request finished (drain timeout {timeout_s:g} s); retry it")
                for handle in list(self._active.values()):
                    self._end(handle, error)
