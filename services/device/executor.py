"""Asynchronous step execution: submit without waiting, complete in order, slot-local outputs.

How one step moves through this module:

1. ``StepExecutor.submit(admitted)`` takes a free output slot (waiting only for a ``release``,
   never for a completion), stages the step's inputs on the device (transient uploads), launches
   the step's device work on the backend and returns a `StepTicket` at once (the device's handle;
   reclaim learns of it from the wire message ``CompletionTicket``).
2. The completion thread waits the tickets in submission order; each ticket's resolution reads
   the sampled ids (+ logprobs) out of that step's slot-local host buffers, hands the ids to the
   runner's ``observe`` (structured output advances its matchers there, see `grammar`) and frees
   the transient uploads. The thread hands the `StepResult` (or the error) to ``on_output``.
3. ``release(ticket_id)`` (reclaim has read the output) frees the slot for a later step.

``--dispatch sync`` takes the same path and additionally waits each ticket inside ``submit``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import accumulate
from typing import Protocol

import torch

from stageserve.device.backends import Backend, Completion, FailedCompletion
from stageserve.device.step_plan import AdmittedStep
from stageserve.tracing import Tracer

log = logging.getLogger(__name__)

DISPATCH_MODES = ("async", "sync")
# The span around submit per dispatch mode; sync marks its one blocking span as the tracing contract asks.
_SUBMIT_SPANS = {"async": ("device.submit", {}), "sync": ("device.blocking_step", {"timing_source": "blocking_span"})}
# The completion thread logs a step that has not completed after this long (it keeps waiting).
_STALL_LOG_S = 30.0


class SlotTimeout(TimeoutError):
    """No output slot was released within the time ``submit`` was allowed to wait."""


class TicketTimeout(TimeoutError):
    """``StepTicket.wait`` timed out; the step may still complete, so waiting again is allowed."""


@dataclass(frozen=True)
class SlotBuffers:
    """Host buffers of one output slot (pinned on accelerators), written by the step's device-to-host copy.

    Attributes:
        token_ids: ``[max_rows]`` int64, sampled id of sampling row ``r`` at ``[r]`` (speculative
            decoding: of sampling entry ``e``, a decode row having ``1 + k`` consecutive entries).
        logprobs: ``[max_rows]`` float32, log-probability of the sampled id.
        top_token_ids: ``[max_rows, max_top_logprobs]`` int64, most likely first.
        top_logprobs: ``[max_rows, max_top_logprobs]`` float32.
        num_tokens, num_drafted: ``[max_rows]`` int64, speculative decoding only: per sampling row,
            tokens it emits (its first entries) and drafts the proposer made for it.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_token_ids: torch.Tensor
    top_logprobs: torch.Tensor
    num_tokens: torch.Tensor
    num_drafted: torch.Tensor


@dataclass(frozen=True)
class SampledLogprob:
    """Log-probability (natural log) of one sampled token and the top-n alternatives at that position."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class StepResult:
    """What one completed step produced, in the ticket's sampling-row order.

    Attributes:
        token_ids: one sampled id per sampling row (speculative decoding: ``num_tokens[r]`` per row).
        logprobs: one entry per token id when any row asked for logprobs (``None`` for rows
            that did not), else ``None``.
        completed_unix_ns: wall-clock time the completion was observed.
        num_tokens, num_drafted: per sampling row, tokens emitted and drafts proposed, on a
            speculating device; else ``None``.
        row_errors: sampling row -> why that row's request fails (the runner's `StepRunner.observe`).
    """

    token_ids: list[int]
    logprobs: list[SampledLogprob | None] | None
    completed_unix_ns: int
    num_tokens: list[int] | None = None
    num_drafted: list[int] | None = None
    row_errors: dict[int, str] = field(default_factory=dict)

    def first_tokens(self) -> list[int]:
        """Each sampling row's first token (speculative decoding: the one after its pending token)."""
        if self.num_tokens is None:
            return self.token_ids
        return [self.token_ids[start] for start in accumulate([0, *self.num_tokens[:-1]])]


class StepRunner(Protocol):
    """The step's device work, split where the backend needs it (see `backends`)."""

    def stage(self, admitted: AdmittedStep) -> object:
        """Build the step's input tensors on the device (the transient uploads) and return them."""
        ...

    def run(self, staged: object, out: SlotBuffers) -> None:
        """Enqueue the forward pass, sampling, device-state updates and the copy into ``out``."""
        ...

    def observe(self, staged: object, result: StepResult | None) -> dict[int, str]:
        """Learn the step's outputs once they are on the host (``None``: the step failed);
        called once per step, in submission order, before its output is delivered. Returns
        ``{sampling row: message}`` of the rows whose request fails (the rest of the step goes on)."""
        ...


class StepTicket:
    """Handle to one submitted step: the only way to learn its outputs or its failure.

    Wait contract (`wait`): idempotent and thread-safe. The first call that observes the step's
    completion reads the outputs from the step's slot buffers, frees the step's transient uploads
    and stores the `StepResult`, or stores the step's exception and frees the uploads too. Every
    later or concurrent call returns that same result object or raises that same exception object.
    The uploads are freed exactly once (`uploads_freed` counts it) whether the step succeeded or failed.

    Attributes:
        ticket_id: unique per executor, increasing in submission order (starts at 1).
        step_id: the step's ``step_id``.
        admitted: the step the ticket was submitted for.
        slot: index of the output slot the step writes.
        submitted_unix_ns: wall-clock submit time.
        uploads_freed: 0 until resolution, then 1.

    ``tracer`` records the ``device.copy_out`` span of the resolution (outputs out of the slot; with
    speculative decoding its args ``draft_tokens`` and ``accepted_tokens`` sum the step's rows).
    """

    def __init__(self, ticket_id: int, admitted: AdmittedStep, slot: int, buffers: SlotBuffers, tracer: Tracer) -> None:
        self.ticket_id = ticket_id
        self.step_id = admitted.step.step_id
        self.admitted = admitted
        self.slot = slot
        self.submitted_unix_ns = time.time_ns()
        self.uploads_freed = 0
        self._buffers = buffers
        self._tracer = tracer
        self._completion: Completion | None = None
        self._uploads: object = None
        self._observe: Callable[[object, StepResult | None], dict[int, str]] | None = None
        self._resolve_lock = threading.Lock()
        self._resolved = threading.Event()
        self._result: StepResult | None = None
        self._error: BaseException | None = None

    def _bind(self, completion: Completion, uploads: object, observe: Callable[[object, list[int] | None], dict[int, str]]) -> None:
        self._completion, self._uploads, self._observe = completion, uploads, observe

    def done(self) -> bool:
        """True once the ticket is resolved (a `wait` has observed success or failure)."""
        return self._resolved.is_set()

    def wait(self, timeout: float | None = None) -> StepResult:
        """Wait for the step; return its `StepResult`.

        Args:
            timeout: seconds to wait at most; ``None`` waits without limit.

        Raises:
            TicketTimeout: not completed within ``timeout`` (nothing is stored; wait again later).
            BaseException: the exception the step failed with, the same object for every waiter.
        """
        if not self._resolved.is_set():
            deadline = None if timeout is None else time.monotonic() + timeout
            if not self._resolve_lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                raise TicketTimeout(f"ticket {self.ticket_id} (step {self.step_id}) not completed within {timeout} s")
            try:
                if not self._resolved.is_set():
                    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                    self._resolve(remaining)
            finally:
                self._resolve_lock.release()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _resolve(self, timeout: float | None) -> None:
        assert self._completion is not None, "ticket waited before it was launched"
        try:
            if not self._completion.wait(timeout):
                raise TicketTimeout(f"ticket {self.ticket_id} (step {self.step_id}) not completed within {timeout} s")
            with self._tracer.span("device.copy_out", step_id=self.step_id, ticket=self.ticket_id) as span:
                result = self._read_outputs()
                if result.num_drafted is not None and self._tracer.enabled:  # the trace analyzer's acceptance
                    span.set(draft_tokens=sum(result.num_drafted), accepted_tokens=len(result.token_ids) - len(result.num_tokens))
                if self._uploads is not None:
                    result = replace(result, row_errors=self._observe(self._uploads, result))
                self._result = result
        except TicketTimeout:
            raise
        except BaseException as exc:  # noqa: BLE001 - stored and re-raised to every waiter
            traceback.clear_frames(exc.__traceback__)  # their locals would keep the step's inputs alive
            self._error = exc
            self._observe_failure()
        self._uploads = None  # the step's device work is over: its inputs may go
        self.uploads_freed += 1
        self._resolved.set()

    def _observe_failure(self) -> None:
        """Tell the runner the step failed (so nothing waits for its tokens); a second failure is logged."""
        if self._uploads is None or self._result is not None:
            return
        try:
            self._observe(self._uploads, None)
        except Exception:  # noqa: BLE001 - the step has failed already
            log.exception("observing failed step %d", self.step_id)

    def _read_outputs(self) -> StepResult:
        step, buffers = self.admitted.step, self._buffers
        rows = len(step.sampled_seq_index)
        entries = [1 + k for k in step.sampled_num_drafts] if step.speculative else [1] * rows
        count = sum(entries)
        token_ids = buffers.token_ids[:count].tolist()
        # Entry e belongs to row owner[e]; a speculative row keeps its first num_tokens[r] entries.
        owner = [r for r, n in enumerate(entries) for _ in range(n)]
        num_tokens = num_drafted = None
        kept = range(count)
        if step.speculative:
            num_tokens, num_drafted = buffers.num_tokens[:rows].tolist(), buffers.num_drafted[:rows].tolist()
            starts = [0, *accumulate(entries)]
            kept = [e for r in range(rows) for e in range(starts[r], starts[r] + num_tokens[r])]
        logprobs = None
        top_n = self.admitted.sampled_top_logprobs
        if any(top_n):
            lp = buffers.logprobs[:count].tolist()
            top_ids = buffers.top_token_ids[:count].tolist()
            top_lp = buffers.top_logprobs[:count].tolist()
            logprobs = [
                SampledLogprob(token_ids[e], lp[e], top_ids[e][: top_n[owner[e]]], top_lp[e][: top_n[owner[e]]]) if top_n[owner[e]] else None
                for e in kept
            ]
        return StepResult([token_ids[e] for e in kept], logprobs, time.time_ns(), num_tokens, num_drafted)


class StepExecutor:
    """Submits steps to a backend without waiting and completes them in order on its completion thread.

    Args:
        backend: where the device work runs.
        runner: the step's device work (stage + run).
        pipeline_depth: output slots, i.e. steps submitted and not yet released, at most.
        max_rows: sampling entries one step may have (the sequence table size; times 1 + K with
            speculative decoding, each decode row sampling after its pending token and every draft).
        max_top_logprobs: top-n alternatives a row may ask for, at most.
        dispatch: ``async`` or ``sync`` (wait each step inside ``submit``).
        on_ticket: called in ``submit`` with each new ticket, before its output can be delivered.
        on_output: called on the completion thread with ``(ticket, result, error)`` (exactly one of the two set),
            in submission order.
        tracer: records ``device.submit`` / ``device.wait`` spans (``device.blocking_step`` in sync
            mode) with ``step_id`` and ``ticket``, and ``device.upload`` / ``device.copy_out`` inside
            them; a disabled tracer costs one attribute check.

    Raises:
        ValueError: ``pipeline_depth < 1`` or an unknown dispatch mode.
    """

    def __init__(
        self,
        backend: Backend,
        runner: StepRunner,
        *,
        pipeline_depth: int,
        max_rows: int,
        max_top_logprobs: int,
        dispatch: str = "async",
        on_ticket: Callable[[StepTicket], None] = lambda ticket: None,
        on_output: Callable[[StepTicket, StepResult | None, BaseException | None], None] = lambda *a: None,
        tracer: Tracer | None = None,
    ) -> None:
        if pipeline_depth < 1:
            raise ValueError(f"--pipeline-depth must be at least 1, got {pipeline_depth}")
        if dispatch not in DISPATCH_MODES:
            raise ValueError(f"--dispatch {dispatch!r}: choose one of {', '.join(DISPATCH_MODES)}")
        self.backend, self.runner, self.dispatch = backend, runner, dispatch
        self.pipeline_depth = pipeline_depth
        self._on_ticket, self._on_output = on_ticket, on_output
        self._tracer = tracer or Tracer("device")
        self._slot_buffers = [_make_slot_buffers(backend, max_rows, max(1, max_top_logprobs)) for _ in range(pipeline_depth)]
        self._lock = threading.Condition()
        self._free_slots = list(range(pipeline_depth))
        self._unreleased: dict[int, _SlotHold] = {}  # ticket id -> its slot's state
        self._next_ticket_id = 1
        self._submitted = 0
        self._delivered = 0
        self._to_complete: queue.SimpleQueue[StepTicket | None] = queue.SimpleQueue()
        self._completion_thread = threading.Thread(target=self._complete_in_order, name="device-completion", daemon=True)
        self._completion_thread.start()

    def wait_for_free_slot(self, timeout: float | None) -> bool:
        """Block until an output slot is free or ``timeout`` seconds passed; True if one is free."""
        with self._lock:
            return self._lock.wait_for(lambda: bool(self._free_slots), timeout)

    def submit(self, admitted: AdmittedStep, slot_timeout: float | None = None) -> StepTicket:
        """Launch ``admitted`` and return its ticket without waiting for the step to complete.

        Waits for a free output slot at most ``slot_timeout`` seconds (``None``: no limit). A failure
        while staging or launching does not raise here: it is stored in the ticket.

        Raises:
            SlotTimeout: every slot still holds an unreleased output after ``slot_timeout``.
        """
        with self._lock:
            if not self._lock.wait_for(lambda: bool(self._free_slots), slot_timeout):
                raise SlotTimeout(f"no output slot released within {slot_timeout} s (pipeline depth {self.pipeline_depth})")
            slot = self._free_slots.pop(0)
            ticket = StepTicket(self._next_ticket_id, admitted, slot, self._slot_buffers[slot], self._tracer)
            self._next_ticket_id += 1
            self._unreleased[ticket.ticket_id] = _SlotHold(slot)
            self._submitted += 1
        span_name, span_args = _SUBMIT_SPANS[self.dispatch]
        with self._tracer.span(span_name, step_id=ticket.step_id, ticket=ticket.ticket_id, batch_size=len(admitted.step.seq_index), **span_args):
            self._launch(ticket)
            self._on_ticket(ticket)
            if self.dispatch == "sync":
                try:
                    ticket.wait()
                except Exception:  # noqa: BLE001 - stored in the ticket, delivered by the completion thread
                    pass
        self._to_complete.put(ticket)
        return ticket

    def _launch(self, ticket: StepTicket) -> None:
        buffers = self._slot_buffers[ticket.slot]
        uploads = None
        try:
            with self._tracer.span("device.upload", step_id=ticket.step_id):
                uploads = self.backend.stage(partial(self.runner.stage, ticket.admitted))
            # partial, not a closure: a failed step's traceback keeps its frames' functions alive,
            # and a closure would keep the uploads with them.
            completion = self.backend.launch(partial(self.runner.run, uploads, buffers))
        except Exception as exc:  # noqa: BLE001 - the step fails, the executor keeps serving
            completion = FailedCompletion(exc)
        ticket._bind(completion, uploads, self.runner.observe)

    def release(self, ticket_id: int) -> bool:
        """Free the slot of ``ticket_id`` once its output has been read.

        A release that arrives before the step's output was delivered takes effect right after
        delivery, so a slot never returns to the pool while its step can still write it.
        Returns False for an unknown or already released ticket (a release is idempotent).
        """
        with self._lock:
            hold = self._unreleased.get(ticket_id)
            if hold is None:
                return False
            hold.release_requested = True
            if hold.delivered:
                self._free(ticket_id)
            return True

    def in_flight(self) -> int:
        """Tickets submitted whose outputs the completion thread has not delivered yet."""
        with self._lock:
            return self._submitted - self._delivered

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every submitted ticket's output has been delivered; True unless timed out."""
        with self._lock:
            return self._lock.wait_for(lambda: self._delivered == self._submitted, timeout)

    def close(self) -> None:
        """Deliver what is in flight, stop the completion thread and the backend."""
        self._to_complete.put(None)
        self._completion_thread.join()
        self.backend.close()

    def _free(self, ticket_id: int) -> None:
        hold = self._unreleased.pop(ticket_id)
        self._free_slots.append(hold.slot)
        self._lock.notify_all()

    def _complete_in_order(self) -> None:
        while (ticket := self._to_complete.get()) is not None:
            if self.dispatch == "sync":
                result, error = self._wait_logging_stalls(ticket)
            else:
                with self._tracer.span("device.wait", step_id=ticket.step_id, ticket=ticket.ticket_id):
                    result, error = self._wait_logging_stalls(ticket)
            try:
                self._on_output(ticket, result, error)
            except Exception:  # noqa: BLE001 - a consumer bug must not stop completions
                log.exception("on_output failed for ticket %d", ticket.ticket_id)
            with self._lock:
                self._delivered += 1
                hold = self._unreleased.get(ticket.ticket_id)
                if hold is not None:
                    hold.delivered = True
                    if hold.release_requested:
                        self._free(ticket.ticket_id)
                self._lock.notify_all()

    @staticmethod
    def _wait_logging_stalls(ticket: StepTicket) -> tuple[StepResult | None, BaseException | None]:
        while True:
            try:
                return ticket.wait(_STALL_LOG_S), None
            except TicketTimeout:
                log.warning("step %d (ticket %d) still not complete after %.0f s", ticket.step_id, ticket.ticket_id, _STALL_LOG_S)
            except BaseException as exc:  # noqa: BLE001 - the step's failure, delivered as such
                log.error("step %d (ticket %d) failed", ticket.step_id, ticket.ticket_id, exc_info=exc)
                return None, exc


@dataclass
class _SlotHold:
    slot: int
    delivered: bool = False
    release_requested: bool = False


def _make_slot_buffers(backend: Backend, max_rows: int, max_top: int) -> SlotBuffers:
    return SlotBuffers(
        token_ids=backend.host_buffer((max_rows,), torch.int64),
        logprobs=backend.host_buffer((max_rows,), torch.float32),
        top_token_ids=backend.host_buffer((max_rows, max_top), torch.int64),
        top_logprobs=backend.host_buffer((max_rows, max_top), torch.float32),
        num_tokens=backend.host_buffer((max_rows,), torch.int64),
        num_drafted=backend.host_buffer((max_rows,), torch.int64),
    )
