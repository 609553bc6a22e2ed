"""Transparent recovery: a request whose device or reclaim failed goes on on another device (or the
same one once it is back), and its client's stream simply continues.

prepare sees every token a request publishes (its :class:`Resumption`, fed by its
``RequestHandle``). When the device's session ends (its ``Execute`` stream broke, it stalled past
``--step-timeout``, reclaim's stream broke), the engine hands its requests to the router, which
places each again as :meth:`Resumption.resumed_request`: a prefill of the prompt and the output up
to the last *settled* token (reclaim's ``SequenceEvent.settled``: nothing held back, the text of
every token so far is published). The new sequence regenerates the tokens published after that
point, with the same draws (every request has a seed, and the device's sampling is counter-based
on (seed, output index): ``SequenceStart.output_offset`` continues the index), and
:meth:`Resumption.translate` drops the ids and the characters the client already has, checking
that they match. So nothing is duplicated or missing, the request ends with one terminal message,
and ``usage`` counts each token once. The prefix cache makes the re-prefill cheap on the same
device; elsewhere it costs one prefill of prompt + output.

A structured-output request resumes too: the new device's matcher accepts the output up to the
settled point before its first mask (``grammar.py``). Not resumed (they fail with ``UNAVAILABLE``
as before): one that diverges when regenerated (a device whose tokens depend on the batch), and one
no device takes back within ``RESUME_TIMEOUT_S``.
"""

from __future__ import annotations

from dataclasses import replace

import grpc

from stageserve.prepare.errors import RequestError
from stageserve.prepare.validation import GenerationRequest
from stageserve.v1 import common_pb2, reclaim_pb2

RESUME_TIMEOUT_S = 30.0
"""How long a request whose device failed waits for a device to take it back before it fails."""


class Resumption:
    """What one request has published, and how its current sequence maps onto it.

    Attributes:
        original: the request as accepted.
        generated: every token id published so far, in order.
        settled: tokens through which every character of the text is published.
        text_since_settled: characters published after ``settled``.
    """

    def __init__(self, original: GenerationRequest) -> None:
        self.original = original
        self.generated: list[int] = []
        self.settled = 0
        self.text_since_settled = 0
        self._drafts = self._accepted = 0  # speculative decoding totals so far
        self._skip_ids: list[int] = []  # published ids the current sequence regenerates first
        self._skip_chars = 0  # published characters it regenerates first
        self._offset = 0  # output tokens before the current sequence's first
        self._draft_base = self._accepted_base = 0

    def resumed_request(self) -> GenerationRequest:
        """The request that continues this one from its last settled token (and counts as it)."""
        done, original = self.settled, self.original
        stop = common_pb2.StopParams()
        stop.CopyFrom(original.stop)
        stop.max_tokens -= done
        stop.min_tokens = max(0, stop.min_tokens - done)
        stop.prompt_tokens = original.num_prompt_tokens + done
        self._skip_ids, self._skip_chars, self._offset = self.generated[done:], self.text_since_settled, done
        self._draft_base, self._accepted_base = self._drafts, self._accepted
        return replace(original, prompt_token_ids=original.prompt_token_ids + self.generated[:done], max_tokens=original.max_tokens - done,
                       stop=stop, output_offset=done)

    def translate(self, event: reclaim_pb2.SequenceEvent) -> reclaim_pb2.SequenceEvent | None:
        """``event`` of the current sequence in the request's own terms, recorded: the regenerated
        ids and characters dropped, the counts offset; ``None`` when nothing is left to show.

        Raises:
            RequestError: ``UNAVAILABLE``: the regenerated tokens differ from those published.
        """
        if self._offset == 0 and not self._skip_ids and not self._skip_chars:
            self._record(event)
            return event
        ids, skip = list(event.token_ids), min(len(self._skip_ids), len(event.token_ids))
        if ids[:skip] != self._skip_ids[:skip]:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"the request was resumed after its device failed, but its tokens from position"
                               f" {len(self.generated) - len(self._skip_ids)} came out differently; retry the request")
        del self._skip_ids[:skip]
        chars = min(self._skip_chars, len(event.text))
        self._skip_chars -= chars
        shown = reclaim_pb2.SequenceEvent()
        shown.CopyFrom(event)
        del shown.token_ids[:skip]
        if len(shown.logprobs) == len(ids):
            del shown.logprobs[:skip]
        shown.text = event.text[chars:]
        shown.prompt_tokens = self.original.num_prompt_tokens
        shown.completion_tokens = event.completion_tokens + self._offset
        shown.draft_tokens, shown.accepted_tokens = event.draft_tokens + self._draft_base, event.accepted_tokens + self._accepted_base
        self._record(shown)
        if not (shown.token_ids or shown.text or shown.finish_reason or shown.error_code):
            return None
        return shown

    def _record(self, event: reclaim_pb2.SequenceEvent) -> None:
        self.generated += event.token_ids
        self._drafts, self._accepted = event.draft_tokens, event.accepted_tokens
        if event.settled and not self._skip_ids and not self._skip_chars:
            self.settled, self.text_since_settled = len(self.generated), 0
        else:
            self.text_since_settled += len(event.text)
