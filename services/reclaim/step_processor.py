"""The sequence table and per-step output processing: the only place in reclaim that loops over rows.

A sequence is registered when the ticket of its first step arrives (``CompletionTicket.started``)
and leaves the table with its terminal event. Each completed step becomes one ``StepEvents``:

1. aborted request ids of the step's ticket → terminal ``FINISH_REASON_ABORT`` events;
2. each sampling row → look up ``(seq_index, generation)``; a row of a sequence that has already
   finished is discarded (finish lag); otherwise append the token, detokenize, check stops and add
   a ``SequenceEvent`` (terminal when the sequence finished). With speculative decoding a row
   carries several tokens (``StepOutput.num_tokens``): they are appended in order and the run is
   cut right after the token that finishes the sequence (a stop token or string, ``max_tokens``),
   so nothing past a finish is ever published. A row listed in ``StepOutput.row_errors`` (e.g. its
   constraint rejected the token) instead fails its request alone (``INTERNAL``, the device's
   message) and its tokens are not published.

A failed step (``StepOutput.error``, a completion timeout, a lost device stream) instead gives
every live sequence of the step a terminal event carrying a gRPC status code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Collection, Iterable

import grpc

from stageserve.logs import REQUEST_ID
from stageserve.reclaim.detokenizer import DetokenizerState, IncrementalDetokenizer
from stageserve.reclaim.stop_checker import StopChecker
from stageserve.v1 import common_pb2, device_pb2, reclaim_pb2

log = logging.getLogger(__name__)

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT
INTERNAL = grpc.StatusCode.INTERNAL.value[0]


@dataclass(slots=True)
class RequestState:
    """One live sequence: identity, usage counters, detokenizer and stop state."""

    request_id: str
    seq_index: int
    generation: int
    prompt_tokens: int
    wants_logprobs: bool
    detok: DetokenizerState
    stops: StopChecker
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class StepProcessor:
    """Turns tickets and step outputs of one device instance into ``StepEvents``.

    Args:
        detokenizer: shared incremental detokenizer (holds the tokenizer's decode).
        eos_token_ids: the model's EOS ids (``AttachReply.eos_token_ids``).
        vocab_size: token ids outside ``[0, vocab_size)`` fail their step (``INTERNAL``).
        max_num_seqs: size of the device's sequence table; bounds the live map.
        device_instance_id: copied into every ``StepEvents``.

    Live sequences are keyed by ``seq_index`` holding one ``generation`` each, i.e. a map keyed by
    ``(seq_index, generation)`` of at most ``max_num_seqs`` entries. Not thread-safe.
    """

    def __init__(
        self,
        detokenizer: IncrementalDetokenizer,
        eos_token_ids: Collection[int],
        vocab_size: int,
        max_num_seqs: int,
        device_instance_id: str,
    ) -> None:
        self._detok = detokenizer
        self._eos_token_ids = frozenset(eos_token_ids)
        self._vocab_size = vocab_size
        self._max_num_seqs = max_num_seqs
        self._instance_id = device_instance_id
        self._live: dict[int, RequestState] = {}  # seq_index -> state
        self._by_request: dict[str, RequestState] = {}
        # Terminal events decided when a ticket arrived, published with that ticket's step.
        self._early: dict[int, list[reclaim_pb2.SequenceEvent]] = {}

    @property
    def live_count(self) -> int:
        """Sequences that have not had their terminal event yet."""
        return len(self._live)

    def start(self, ticket: device_pb2.CompletionTicket) -> None:
        """Register the sequences that first appear in ``ticket``'s step.

        A ``seq_index`` outside the device's table fails that request (``INTERNAL``); a
        ``seq_index`` still held by an older live sequence ends the older one (``ABORT`` when the
        same ticket aborts it, else ``INTERNAL``). These terminal events are published with this
        ticket's step.
        """
        for start in ticket.started:
            if start.seq_index >= self._max_num_seqs:
                message = f"seq_index {start.seq_index} is outside the device's table of {self._max_num_seqs} sequences"
                self._fail_early(ticket, reclaim_pb2.SequenceEvent(
                    request_id=start.request_id, seq_index=start.seq_index, generation=start.generation,
                    error_code=INTERNAL, error_message=message,
                ))
                continue
            previous = self._live.get(start.seq_index)
            if previous is not None and previous.request_id in ticket.aborted:
                self._early.setdefault(ticket.ticket, []).append(self._abort_event(previous))
                self._remove(previous)
            elif previous is not None:
                message = f"seq_index {start.seq_index} was reused by request {start.request_id!r} while live"
                self._fail_early(ticket, self._error_event(previous, INTERNAL, message))
                self._remove(previous)
            state = RequestState(
                request_id=start.request_id,
                seq_index=start.seq_index,
                generation=start.generation,
                prompt_tokens=start.stop.prompt_tokens or len(start.prompt_token_ids),
                wants_logprobs=start.sampling.logprobs > 0,
                detok=IncrementalDetokenizer.start(start.prompt_token_ids),
                stops=StopChecker(start.stop, self._eos_token_ids),
            )
            self._live[start.seq_index] = state
            self._by_request[start.request_id] = state

    def complete(self, ticket: device_pb2.CompletionTicket, output: device_pb2.StepOutput) -> reclaim_pb2.StepEvents:
        """Process ``output`` of ``ticket``'s step (see the module docstring for the order)."""
        if output.error:
            return self.fail_step(ticket, INTERNAL, f"step {ticket.step_id} failed on the device: {output.error}")
        rows = len(ticket.seq_index)
        counts = list(output.num_tokens) or [1] * rows
        tokens = len(output.token_ids)
        if (len(counts) != rows or tokens != sum(counts) or len(ticket.generation) != rows or len(output.logprobs) not in (0, tokens)
                or len(output.num_drafted) not in (0, rows)):
            return self.fail_step(
                ticket,
                INTERNAL,
                f"step {ticket.step_id}: output has {tokens} token ids, {len(output.logprobs)} logprobs and {len(output.num_tokens)} "
                f"token counts for {rows} sampling rows ({len(ticket.generation)} generations)",
            )
        if rows and not (0 <= min(output.token_ids) and max(output.token_ids) < self._vocab_size):
            return self.fail_step(ticket, INTERNAL, f"step {ticket.step_id}: a sampled token id is outside [0, {self._vocab_size})")
        step = self._new_step(ticket)
        self._abort(ticket.aborted, step)
        live = self._live
        with_logprobs = len(output.logprobs) > 0
        drafted = output.num_drafted or [0] * rows
        first = 0
        for row, (seq_index, generation, count, row_drafts) in enumerate(zip(ticket.seq_index, ticket.generation, counts, drafted)):
            start, first = first, first + count
            state = live.get(seq_index)
            if state is None or state.generation != generation:
                continue  # finish lag: this sequence already finished
            if row in output.row_errors:
                log.error("step %d: request fails: %s", ticket.step_id, output.row_errors[row], extra={REQUEST_ID: state.request_id})
                step.events.append(self._error_event(state, INTERNAL, output.row_errors[row]))
                self._remove(state)
                continue
            event = step.events.add(request_id=state.request_id, seq_index=seq_index, generation=generation)
            if output.embeddings and row in output.embeddings:  # an embedding's prompt ended: its one sampled token ends it (max_tokens 1)
                event.embedding.extend(output.embeddings[row].values)
            finished = False
            for i in range(start, first):
                if with_logprobs and state.wants_logprobs:
                    event.logprobs.append(output.logprobs[i])
                if finished := self._advance(state, output.token_ids[i], event):
                    break
            # Of the row's run, the accepted drafts come first: those published are accepted.
            state.draft_tokens += row_drafts
            state.accepted_tokens += min(len(event.token_ids), count - 1)
            event.draft_tokens, event.accepted_tokens = state.draft_tokens, state.accepted_tokens
            if finished:
                self._remove(state)
            else:  # whether prepare could resume the sequence from here with the text exact
                event.settled = not state.stops.holding and not state.detok.pending
        return step

    def fail_step(self, ticket: device_pb2.CompletionTicket, code: int, message: str) -> reclaim_pb2.StepEvents:
        """Abort the ticket's aborted ids, then fail every live sequence of its step with ``code``."""
        step = self._new_step(ticket)
        step.error_code, step.error_message = code, message
        self._abort(ticket.aborted, step)
        members = [(start.seq_index, start.generation) for start in ticket.started]
        members += zip(ticket.seq_index, ticket.generation)
        self._fail(members, code, message, step)
        return step

    def fail_all(self, code: int, message: str, tickets: Iterable[device_pb2.CompletionTicket]) -> list[reclaim_pb2.StepEvents]:
        """Fail everything (the device stream is gone).

        Returns one ``StepEvents`` per held ticket, oldest first (their steps fail), then, if any
        sequence is still live, one with ``ticket == 0`` (no step) failing the rest.
        """
        steps = [self.fail_step(ticket, code, message) for ticket in tickets]
        rest = reclaim_pb2.StepEvents(device_instance_id=self._instance_id)
        for events in self._early.values():
            rest.events.extend(events)
        self._early.clear()
        self._fail([(s.seq_index, s.generation) for s in list(self._live.values())], code, message, rest)
        if rest.events:
            steps.append(rest)
        return steps

    def _advance(self, state: RequestState, token_id: int, event: reclaim_pb2.SequenceEvent) -> bool:
        """Append one token to ``state``, add it to ``event`` (its text appended to what the row's
        earlier tokens put there); return whether the sequence finished."""
        n = state.completion_tokens = state.completion_tokens + 1
        event.token_ids.append(token_id)
        event.completion_tokens = n
        event.prompt_tokens = state.prompt_tokens
        stops, detok = state.stops, self._detok
        stop_token_id = stops.stop_token(token_id, n)
        if stop_token_id is not None:
            text = detok.step(state.detok, token_id) if stops.include_stop_str_in_output else ""
            event.text += stops.release(text + detok.flush(state.detok))
            event.finish_reason = STOP
            event.stop_token_id = stop_token_id
            return True
        text, stop_string = stops.scan(detok.step(state.detok, token_id), n)
        if stop_string is not None:
            event.text += text
            event.finish_reason = STOP
            event.stop_string = stop_string
            return True
        if stops.length_reached(n):
            event.text += text + stops.release(detok.flush(state.detok))
            event.finish_reason = LENGTH
            return True
        event.text += text
        return False

    def _abort(self, request_ids: Iterable[str], step: reclaim_pb2.StepEvents) -> None:
        for request_id in request_ids:
            state = self._by_request.get(request_id)
            if state is None:
                log.debug("abort ignored: not live (already finished, or never started)", extra={REQUEST_ID: request_id})
                continue
            step.events.append(self._abort_event(state))
            self._remove(state)

    def _abort_event(self, state: RequestState) -> reclaim_pb2.SequenceEvent:
        """The terminal ABORT event, with the text held back so far (it can no longer become a stop string)."""
        return reclaim_pb2.SequenceEvent(
            request_id=state.request_id,
            seq_index=state.seq_index,
            generation=state.generation,
            text=state.stops.release(self._detok.flush(state.detok)),
            finish_reason=ABORT,
            prompt_tokens=state.prompt_tokens,
            completion_tokens=state.completion_tokens,
        )

    def _fail(self, members: Iterable[tuple[int, int]], code: int, message: str, step: reclaim_pb2.StepEvents) -> None:
        for seq_index, generation in members:
            state = self._live.get(seq_index)
            if state is None or state.generation != generation:
                continue  # finished already, or listed twice (a started sequence with a row)
            step.events.append(self._error_event(state, code, message))
            self._remove(state)

    def _fail_early(self, ticket: device_pb2.CompletionTicket, event: reclaim_pb2.SequenceEvent) -> None:
        log.error("step %d: request fails: %s", ticket.step_id, event.error_message, extra={REQUEST_ID: event.request_id})
        self._early.setdefault(ticket.ticket, []).append(event)

    @staticmethod
    def _error_event(state: RequestState, code: int, message: str) -> reclaim_pb2.SequenceEvent:
        return reclaim_pb2.SequenceEvent(
            request_id=state.request_id,
            seq_index=state.seq_index,
            generation=state.generation,
            prompt_tokens=state.prompt_tokens,
            completion_tokens=state.completion_tokens,
            error_code=code,
            error_message=message,
        )

    def _new_step(self, ticket: device_pb2.CompletionTicket) -> reclaim_pb2.StepEvents:
        step = reclaim_pb2.StepEvents(step_id=ticket.step_id, ticket=ticket.ticket, device_instance_id=self._instance_id)
        step.events.extend(self._early.pop(ticket.ticket, ()))
        return step

    def _remove(self, state: RequestState) -> None:
        del self._live[state.seq_index]
        if self._by_request.get(state.request_id) is state:
            del self._by_request[state.request_id]
