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
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import torch

from stageserve.device.backends import Backend, FailedCompletion
from stageserve.device.step_plan import AdmittedStep
from stageserve.device.step_ticket import SlotBuffers, StepResult, StepTicket, TicketTimeout
from stageserve.tracing import Tracer

log = logging.getLogger(__name__)

DISPATCH_MODES = ("async", "sync")
# The span around submit per dispatch mode; sync marks its one blocking span as the tracing contract asks.
_SUBMIT_SPANS = {"async": ("device.submit", {}), "sync": ("device.blocking_step", {"timing_source": "blocking_span"})}
# The completion thread logs a step that has not completed after this long (it keeps waiting).
_STALL_LOG_S = 30.0


class SlotTimeout(TimeoutError):
    """No output slot was released within the time ``submit`` was allowed to wait."""


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


class StepExecutor:
    """Submits steps to a backend without waiting and completes them in order on its completion thread.

    Args:
        backend: where the device work runs.
        runner: the step's device work (stage + run).
        pipeline_depth: output slots, i.e. steps submitted and not yet released, at most.
        max_rows: sampling entries one step may have (the sequence table size; times 1 + K with
            speculative decoding, each decode row sampling after its pending token and every draft).
        max_top_logprobs: top-n alternatives a row may ask for, at most.
        embedding_width: the model's hidden size where steps output embeddings (0: none do).
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
        embedding_width: int = 0,
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
        self._slot_buffers = [_make_slot_buffers(backend, max_rows, max(1, max_top_logprobs), embedding_width) for _ in range(pipeline_depth)]
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
            completion = self.backend.launch(partial(self.runner.run, uploads, buffers), sum(ticket.admitted.step.num_tokens))
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


def _make_slot_buffers(backend: Backend, max_rows: int, max_top: int, embedding_width: int) -> SlotBuffers:
    return SlotBuffers(
        token_ids=backend.host_buffer((max_rows,), torch.int64),
        logprobs=backend.host_buffer((max_rows,), torch.float32),
        top_token_ids=backend.host_buffer((max_rows, max_top), torch.int64),
        top_logprobs=backend.host_buffer((max_rows, max_top), torch.float32),
        num_tokens=backend.host_buffer((max_rows,), torch.int64),
        num_drafted=backend.host_buffer((max_rows,), torch.int64),
        embeddings=backend.host_buffer((max_rows, embedding_width), torch.float32) if embedding_width else None,
    )
