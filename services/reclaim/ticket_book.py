"""The ticket book: completion tickets held until their step output arrives, released in step order.

The device pushes a ``CompletionTicket`` when it submits a step and the ``StepOutput`` when the
step has completed, both on one ordered stream. The book pairs them and hands out steps strictly
in ticket order: a step is *ready* when its output has arrived, or when its deadline
(``completion_timeout_s`` after its ticket arrived, on this host's monotonic clock) has passed.
A timed-out step is remembered so that its late output is recognised, discarded, and its slot
still released (the device's completion lane writes that slot until then, so it may not be
released earlier).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

from stageserve.v1 import device_pb2

log = logging.getLogger(__name__)

# Timed-out tickets remembered for their late output (only the log message depends on it).
MAX_REMEMBERED_TIMEOUTS = 1024


class DeviceProtocolError(ValueError):
    """The device broke the completion protocol; its stream can no longer be trusted."""


@dataclass
class ReadyStep:
    """A step the book hands out, in step order.

    ``output`` is ``None`` when the step timed out; its slot must then not be released yet.
    """

    ticket: device_pb2.CompletionTicket
    output: device_pb2.StepOutput | None


@dataclass
class _Held:
    ticket: device_pb2.CompletionTicket
    deadline_s: float  # time.monotonic() value
    output: device_pb2.StepOutput | None = None


class TicketBook:
    """Holds tickets until their output arrives or their deadline passes.

    Args:
        completion_timeout_s: seconds a step may take from its ticket's arrival to its output's.

    Not thread-safe: one thread (the device stream's loop) owns it.
    """

    def __init__(self, completion_timeout_s: float) -> None:
        self.completion_timeout_s = completion_timeout_s
        self._held: OrderedDict[int, _Held] = OrderedDict()  # ticket id -> held, in arrival (= step) order
        self._timed_out: OrderedDict[int, int] = OrderedDict()  # ticket id -> step id

    def __len__(self) -> int:
        return len(self._held)

    def add_ticket(self, ticket: device_pb2.CompletionTicket, now_s: float) -> None:
        """Hold ``ticket`` until its output arrives or ``now_s + completion_timeout_s``.

        Raises:
            DeviceProtocolError: the ticket id is 0 or already held.
        """
        if ticket.ticket == 0 or ticket.ticket in self._held:
            raise DeviceProtocolError(f"step {ticket.step_id}: ticket id {ticket.ticket} is 0 or already held")
        self._held[ticket.ticket] = _Held(ticket, now_s + self.completion_timeout_s)

    def add_output(self, output: device_pb2.StepOutput) -> bool:
        """Attach ``output`` to its held ticket.

        Returns:
            ``True`` when the output belongs to no held ticket (it timed out, or its ticket was
            never seen): it is discarded and the caller releases its slot at once. ``False`` when
            it was attached (its slot is released after the step is published).
        """
        held = self._held.get(output.ticket)
        if held is None:
            step_id = self._timed_out.pop(output.ticket, None)
            if step_id is not None:
                log.warning("step %d (ticket %d): late output discarded; slot released", step_id, output.ticket)
            else:
                log.warning("step %d: output for unknown ticket %d discarded; slot released", output.step_id, output.ticket)
            return True
        if held.output is not None:
            log.warning("step %d (ticket %d): duplicate output ignored", output.step_id, output.ticket)
            return False
        held.output = output
        return False

    def pop_ready(self, now_s: float) -> list[ReadyStep]:
        """Steps that are ready, oldest first; stops at the first step still waiting in time."""
        ready = []
        while self._held:
            ticket_id, held = next(iter(self._held.items()))
            if held.output is None and now_s < held.deadline_s:
                break
            del self._held[ticket_id]
            if held.output is None:
                log.warning("step %d (ticket %d): no output within %g s; its sequences fail",
                            held.ticket.step_id, ticket_id, self.completion_timeout_s)
                self._remember_timeout(held.ticket)
            ready.append(ReadyStep(held.ticket, held.output))
        return ready

    def next_deadline_s(self) -> float | None:
        """Deadline of the oldest held step (the earliest one), or ``None`` when nothing is held."""
        if not self._held:
            return None
        return next(iter(self._held.values())).deadline_s

    def clear(self) -> list[device_pb2.CompletionTicket]:
        """Forget everything (the device stream is gone); return the held tickets, oldest first."""
        tickets = [held.ticket for held in self._held.values()]
        self._held.clear()
        self._timed_out.clear()
        return tickets

    def _remember_timeout(self, ticket: device_pb2.CompletionTicket) -> None:
        self._timed_out[ticket.ticket] = ticket.step_id
        if len(self._timed_out) > MAX_REMEMBERED_TIMEOUTS:
            self._timed_out.popitem(last=False)
