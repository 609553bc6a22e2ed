"""The ``stageserve.v1.Device`` servicer: Attach, Execute (prepare's plans), Complete (reclaim's
stream), CompileConstraint (prepare's, before it schedules a constrained request: see `grammar`).

How the streams are driven (see ``docs/pipeline-protocol.md``):

- **Execute** (one at a time; a second gets ``FAILED_PRECONDITION``). Opening it resets the
  sequence table; each plan goes through a `PlanSubmitter` (decode, wait for a free output slot,
  admit, submit) and is answered with its ``StepReceipt`` (a plan with ``refusals_only``, as
  prepare sends them, only when refused). A refused plan gets a receipt with ``error`` set and
  ticket 0; the stream and the service carry on.
- **Complete** (one reclaim at a time). Streams the outbox (tickets and outputs, in submission
  order) and reads ``SlotRelease`` messages. Events wait in the outbox while no reclaim is
  attached; the slots bound that backlog. When the stream ends, the slots of tickets it was sent
  and did not release are released (after their steps complete), and their outputs are dropped.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from stageserve.device.executor import StepExecutor
from stageserve.device.step_ticket import StepResult, StepTicket
from stageserve.device.grammar import GrammarTable
from stageserve.device.plan_submitter import STREAM_POLL_S, PlanSubmitter
from stageserve.device.sequence_table import SequenceTable
from stageserve.device.step_plan import PlanLimits
from stageserve.structured_output import ConstraintError
from stageserve.v1 import common_pb2, device_pb2, device_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "stageserve.v1.Device"
COMPILE_TURN_WAIT_S = 30.0  # how long a CompileConstraint waits for a compile worker before RESOURCE_EXHAUSTED


class CompletionOutbox:
    """Reclaim-bound events in submission order; thread-safe.

    Filled by the executor (``push_ticket`` at submit, ``push_output`` on its completion thread),
    drained by the attached Complete stream (`events`).
    """

    def __init__(self) -> None:
        self._events: collections.deque[device_pb2.CompletionEvent] = collections.deque()
        self._ready = threading.Condition()
        self._orphaned: set[int] = set()  # tickets whose reclaim stream ended: drop their outputs

    def push_ticket(self, ticket: StepTicket) -> None:
        """Queue the wire ``CompletionTicket`` of ``ticket`` for reclaim (forwards the plan's ``started`` and ``aborted``)."""
        step = ticket.admitted.step
        message = device_pb2.CompletionTicket(
            ticket=ticket.ticket_id,
            step_id=step.step_id,
            slot=ticket.slot,
            started=step.plan.started,
            seq_index=step.sampled_seq_index,
            generation=step.sampled_generation,
            aborted=step.plan.aborted,
            submitted_unix_ns=ticket.submitted_unix_ns,
        )
        self.push(device_pb2.CompletionEvent(ticket=message))

    def push_output(self, ticket: StepTicket, result: StepResult | None, error: BaseException | None) -> None:
        """Queue the step's output (or its failure) for reclaim."""
        output = device_pb2.StepOutput(ticket=ticket.ticket_id, step_id=ticket.step_id)
        if error is not None:
            output.error = f"step failed on the device: {type(error).__name__}: {error}"
            output.completed_unix_ns = time.time_ns()
        else:
            assert result is not None
            output.token_ids.extend(result.token_ids)
            if result.num_tokens is not None:
                output.num_tokens.extend(result.num_tokens)
                output.num_drafted.extend(result.num_drafted)
            if result.logprobs is not None:
                output.logprobs.extend(
                    common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_token_ids=lp.top_token_ids, top_logprobs=lp.top_logprobs)
                    if lp is not None else common_pb2.TokenLogprob()
                    for lp in result.logprobs
                )
            output.completed_unix_ns = result.completed_unix_ns
            output.row_errors.update(result.row_errors)
            for row, values in result.embeddings.items():
                output.embeddings[row].values.extend(values)
        self.push(device_pb2.CompletionEvent(output=output))

    def pop(self, timeout: float, claim: Callable[[device_pb2.CompletionEvent], bool] = lambda event: True) -> device_pb2.CompletionEvent | None:
        """The oldest event, or ``None`` after ``timeout`` seconds without one or when ``claim`` refuses it.

        ``claim(event)`` runs under the outbox's lock before the event leaves the queue, so an event
        a consumer refuses (a detached stream) stays first for the next one: no other consumer can
        take a later event between the two, which keeps each ticket ahead of its output.
        """
        with self._ready:
            while True:
                # wait_for, not wait: a notified consumer may find the event already taken by another
                if not self._ready.wait_for(lambda: bool(self._events), timeout):
                    return None
                event = self._events[0]
                if event.WhichOneof("kind") == "output" and event.output.ticket in self._orphaned:
                    self._events.popleft()
                    self._orphaned.discard(event.output.ticket)
                    continue
                if not claim(event):
                    self._ready.wait(timeout)  # a refusing (detached) stream polls at its pace, not in a spin
                    return None
                return self._events.popleft()

    def events(self, keep_going: Callable[[], bool],
               claim: Callable[[device_pb2.CompletionEvent], bool] = lambda event: True) -> Iterator[device_pb2.CompletionEvent]:
        """The events in order as they come, while ``keep_going()`` (asked at least every 0.1 s) and
        ``claim`` takes them (see `pop`)."""
        while keep_going():
            event = self.pop(STREAM_POLL_S, claim)
            if event is not None:
                yield event

    def orphan(self, ticket_ids: list[int]) -> None:
        """Drop the not yet sent outputs of ``ticket_ids`` (their tickets went to a reclaim that is gone)."""
        with self._ready:
            self._orphaned.update(ticket_ids)

    def wait_empty(self, timeout: float) -> bool:
        """Block until every queued event has been taken; True unless timed out (drain)."""
        deadline = time.monotonic() + timeout
        while self._events:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def clear(self) -> None:
        """Drop every queued event (after the warm-up step)."""
        with self._ready:
            self._events.clear()

    def push(self, event: device_pb2.CompletionEvent) -> None:
        """Queue ``event`` last."""
        with self._ready:
            self._events.append(event)
            self._ready.notify()


@dataclass(frozen=True)
class DeviceCore:
    """What the servicer drives once the model is loaded and warmed up.

    Attributes:
        attach_reply: what ``Attach`` answers: model facts, KV pool, limits; ``instance_id`` new per start.
        limits: the same limits, as plans are checked against them.
        table: the sequence table.
        executor: the step executor.
        outbox: the executor's events for reclaim.
        check_sampling: raises ``ValueError`` naming the field for bad ``SamplingParams``.
        grammar: the constrained sequences' grammar state; ``None`` when constraints are not
            applied (the simulated device).
    """

    attach_reply: device_pb2.AttachReply
    limits: PlanLimits
    table: SequenceTable
    executor: StepExecutor
    outbox: CompletionOutbox
    check_sampling: Callable[[common_pb2.SamplingParams], None]
    grammar: GrammarTable | None = None


class DeviceServicer(device_pb2_grpc.DeviceServicer):
    """Serves ``stageserve.v1.Device``; answers ``UNAVAILABLE`` until `serve` gives it a `DeviceCore`."""

    def __init__(self) -> None:
        self._core: DeviceCore | None = None
        self._lock = threading.Condition()
        self._open_streams: set[str] = set()  # "Execute" and/or "Complete"
        self._submit_lock = threading.Lock()  # see PlanSubmitter
        self._drained = threading.Event()  # see end_complete_streams

    def serve(self, core: DeviceCore) -> None:
        """Start answering with ``core`` (after warm-up)."""
        self._core = core

    def Attach(self, request: device_pb2.AttachRequest, context: grpc.ServicerContext) -> device_pb2.AttachReply:
        core = self._require_core(context)
        log.info("attach from %s", request.peer or context.peer())
        return core.attach_reply

    def CompileConstraint(self, request: device_pb2.CompileConstraintRequest, context: grpc.ServicerContext) -> device_pb2.CompileConstraintReply:
        core = self._require_core(context)
        if core.grammar is None:  # constraints are not applied here (the sim)
            return device_pb2.CompileConstraintReply()
        try:
            cached, seconds = core.grammar.grammars.compile_within(request.constraint, request.tenant, COMPILE_TURN_WAIT_S)
        except ConstraintError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TimeoutError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return device_pb2.CompileConstraintReply(cached=cached, compile_seconds=seconds)

    def Execute(self, request_iterator: Iterator[device_pb2.StepPlan], context: grpc.ServicerContext) -> Iterator[device_pb2.StepReceipt]:
        core = self._require_core(context)
        self._open_stream(context, "Execute", "another prepare is attached: the device serves one Execute stream at a time")

        @_once
        def close() -> None:
            self._close_stream("Execute")
            log.info("Execute stream closed")

        # A stream cancelled while its handler waits at a yield is never resumed: the callback closes it.
        context.add_callback(close)
        try:
            submitter = PlanSubmitter(core, self._submit_lock, context.is_active)
            log.info("Execute stream opened by %s; sequence table reset", context.peer())
            for plan in request_iterator:
                receipt = submitter.submit(plan)
                if receipt is None:
                    return
                if receipt.error or not plan.refusals_only:
                    yield receipt
        finally:
            close()

    def Complete(self, request_iterator: Iterator[device_pb2.SlotRelease], context: grpc.ServicerContext) -> Iterator[device_pb2.CompletionEvent]:
        core = self._require_core(context)
        if self._drained.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "the device has drained and is stopping; attach to another device")
        self._open_stream(context, "Complete", "another reclaim is attached: the device serves one Complete stream at a time")
        attachment = _ReclaimAttachment(core)

        def close() -> None:
            if attachment.detach():
                self._close_stream("Complete")

        context.add_callback(close)  # see Execute
        reader = threading.Thread(target=attachment.read_releases, args=(request_iterator,), name="device-slot-releases", daemon=True)
        reader.start()
        log.info("Complete stream opened by %s", context.peer())
        try:
            yield from core.outbox.events(lambda: context.is_active() and reader.is_alive() and not self._drained.is_set(), attachment.take)
        finally:
            close()

    def _require_core(self, context: grpc.ServicerContext) -> DeviceCore:
        core = self._core
        if core is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the device is loading and warming up its model; retry when its readiness is SERVING")
        return core

    def _open_stream(self, context: grpc.ServicerContext, name: str, busy_message: str) -> None:
        with self._lock:
            if name in self._open_streams:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, busy_message)
            self._open_streams.add(name)

    def _close_stream(self, name: str) -> None:
        with self._lock:
            self._open_streams.discard(name)
            self._lock.notify_all()

    def end_complete_streams(self) -> None:
        """After a drain that delivered every event: end the Complete stream (with OK, within 0.1 s,
        after the events it already took) and refuse new ones with ``UNAVAILABLE``, so that the
        server's stop does not wait out its grace for a stream that has nothing more to send."""
        self._drained.set()

    def wait_execute_closed(self, timeout_s: float) -> bool:
        """Wait until no Execute stream is open (prepare let this draining device go); False on timeout.

        prepare keeps the stream while requests it placed here still run, and closes it once the
        last one has ended, so waiting for it lets those requests finish during a drain.
        """
        with self._lock:
            return self._lock.wait_for(lambda: "Execute" not in self._open_streams, timeout_s)


class _ReclaimAttachment:
    """One Complete stream's book of tickets it was sent and has not released; thread-safe.

    ``detach`` (once, when the stream ends) releases those tickets' slots and drops their pending
    outputs; an event offered after that stays in the outbox for the next reclaim.
    """

    def __init__(self, core: DeviceCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._unreleased: set[int] = set()
        self._detached = False

    def take(self, event: device_pb2.CompletionEvent) -> bool:
        """Claim ``event`` for this stream (called under the outbox's lock); False once detached (the
        event then stays in the outbox for the next reclaim)."""
        with self._lock:
            if self._detached:
                return False
            if event.WhichOneof("kind") == "ticket":
                self._unreleased.add(event.ticket.ticket)
            return True

    def read_releases(self, request_iterator: Iterator[device_pb2.SlotRelease]) -> None:
        """Apply the stream's SlotRelease messages until it ends (runs on its own thread)."""
        try:
            for release in request_iterator:
                with self._lock:
                    self._unreleased.discard(release.ticket)
                if not self._core.executor.release(release.ticket):
                    log.warning("SlotRelease for unknown or already released ticket %d", release.ticket)
        except grpc.RpcError:
            pass  # the stream ended; detach cleans up

    def detach(self) -> bool:
        """Release the slots this stream still holds; True the first time, False afterwards."""
        with self._lock:
            if self._detached:
                return False
            self._detached = True
            lost = sorted(self._unreleased)
        self._core.outbox.orphan(lost)
        for ticket_id in lost:
            self._core.executor.release(ticket_id)
        log.info("Complete stream closed; released %d slot(s) it held", len(lost))
        return True


def _once(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` wrapped to run at most once, whichever thread calls first."""
    lock, done = threading.Lock(), [False]

    def run() -> None:
        with lock:
            if done[0]:
                return
            done[0] = True
        fn()

    return run
