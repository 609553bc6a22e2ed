"""The completion handler: reclaim's gRPC-free core for one device stream.

It joins the :class:`~stageserve.reclaim.ticket_book.TicketBook` (pairs tickets with outputs, in
step order, with a completion timeout) and the :class:`~stageserve.reclaim.step_processor.StepProcessor`
(sequence table, detokenization, stops). Every call returns the :class:`Outcome` list the caller
must act on, in order: publish ``events``, then send ``SlotRelease(release_ticket)``. Unit tests
drive it with hand-built tickets and outputs; the service drives it from the device stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from stageserve.reclaim.detokenizer import IncrementalDetokenizer
from stageserve.reclaim.step_processor import StepProcessor
from stageserve.reclaim.ticket_book import DeviceProtocolError, TicketBook
from stageserve.v1 import device_pb2, reclaim_pb2

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


@dataclass(frozen=True)
class Outcome:
    """What to do after handling an event: publish ``events`` (if any), then release ``release_ticket`` (if not 0)."""

    events: reclaim_pb2.StepEvents | None
    release_ticket: int = 0


class CompletionHandler:
    """Handles one attached device's completion stream.

    Args:
        attach: the device's ``AttachReply`` (EOS ids, vocabulary and sequence table sizes, instance id).
        detokenizer: shared incremental detokenizer.
        completion_timeout_s: seconds from a ticket's arrival to its output's before the step fails.

    Not thread-safe: the device stream's loop owns it.
    """

    def __init__(
        self,
        attach: device_pb2.AttachReply,
        detokenizer: IncrementalDetokenizer,
        completion_timeout_s: float,
    ) -> None:
        self.instance_id = attach.instance_id
        self._book = TicketBook(completion_timeout_s)
        self._steps = StepProcessor(
            detokenizer, attach.eos_token_ids, attach.vocab_size, attach.max_num_seqs, attach.instance_id
        )
        self._dispatch = {"ticket": self._on_ticket, "output": self._on_output}

    @property
    def live_count(self) -> int:
        """Sequences still waiting for their terminal event."""
        return self._steps.live_count

    def next_deadline_s(self) -> float | None:
        """Monotonic time at which the oldest held step times out, or ``None``."""
        return self._book.next_deadline_s()

    def handle(self, event: device_pb2.CompletionEvent, now_s: float) -> list[Outcome]:
        """Handle one event of the device stream (dispatch on its ``kind``) at monotonic time ``now_s``.

        Raises:
            DeviceProtocolError: the device broke the protocol (an event with no kind, a ticket id
                reused); the stream can no longer be trusted.
        """
        kind = event.WhichOneof("kind")
        if kind is None:
            raise DeviceProtocolError("a CompletionEvent with neither ticket nor output set")
        return self._dispatch[kind](getattr(event, kind), now_s)

    def expire(self, now_s: float) -> list[Outcome]:
        """Fail steps whose completion timeout has passed (and publish any that became ready after them)."""
        return self._ready(now_s)

    def fail_in_flight(self, message: str) -> list[Outcome]:
        """Fail every held step and live sequence with ``UNAVAILABLE`` (the device stream is gone).

        No slot is released: the slots belong to the lost stream. The handler is empty afterwards.
        """
        return [Outcome(events) for events in self._steps.fail_all(UNAVAILABLE, message, self._book.clear())]

    def _on_ticket(self, ticket: device_pb2.CompletionTicket, now_s: float) -> list[Outcome]:
        self._book.add_ticket(ticket, now_s)
        self._steps.start(ticket)
        return self._ready(now_s)

    def _on_output(self, output: device_pb2.StepOutput, now_s: float) -> list[Outcome]:
        discarded = self._book.add_output(output)
        outcomes = [Outcome(None, output.ticket)] if discarded else []
        return outcomes + self._ready(now_s)

    def _ready(self, now_s: float) -> list[Outcome]:
        outcomes = []
        for step in self._book.pop_ready(now_s):
            ticket = step.ticket
            if step.output is None:
                message = (
                    f"step {ticket.step_id} (ticket {ticket.ticket}): no output from the device within "
                    f"{self._book.completion_timeout_s:g} s (--completion-timeout)"
                )
                outcomes.append(Outcome(self._steps.fail_step(ticket, UNAVAILABLE, message)))
            else:
                outcomes.append(Outcome(self._steps.complete(ticket, step.output), ticket.ticket))
        return outcomes
