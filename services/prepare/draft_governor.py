"""How many drafts the next decode row of one sequence asks the device's proposer for.

Verifying ``k`` drafts costs ``k`` more tokens in the step's forward pass whether the proposer
found anything or the target accepts it. A sequence whose drafts are rarely accepted therefore
stops asking for a while: over a window of asked drafts, when the accepted share falls below
``MIN_ACCEPTANCE``, it asks for none during a pause that doubles on every consecutive failed
window (up to ``MAX_PAUSE_ROWS``), then probes again. This keeps speculation from making an
open-ended workload much slower, while an input-grounded one keeps its drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stageserve.prepare.validation import GenerationRequest

WINDOW_DRAFTS = 32  # asked drafts per judgement
MIN_ACCEPTANCE = 0.15  # accepted / asked below this: pause
FIRST_PAUSE_ROWS = 16  # decode rows without drafts after the first failed window
MAX_PAUSE_ROWS = 512


@dataclass(slots=True)
class DraftGovernor:
    """Per-sequence draft budget (not thread-safe; the scheduler's lock).

    Attributes:
        max_drafts: the device's K (0: speculation off, or the request's sampling forbids it).
        draft_tokens, accepted_tokens: the totals the last published event reported.
    """

    max_drafts: int
    draft_tokens: int = 0
    accepted_tokens: int = 0
    _window_asked: int = 0
    _window_accepted: int = 0
    _paused_rows: int = 0
    _next_pause: int = FIRST_PAUSE_ROWS

    def next_row(self) -> int:
        """Drafts the next decode row asks for (before the step's budget and length caps)."""
        if self._paused_rows:
            self._paused_rows -= 1
            return 0
        return self.max_drafts

    def observe(self, asked: int, draft_tokens: int, accepted_tokens: int) -> None:
        """A published row that asked for ``asked`` drafts; ``draft_tokens``/``accepted_tokens`` are
        the event's running totals (drafts the proposer made, drafts accepted and published)."""
        self._window_asked += asked
        self._window_accepted += accepted_tokens - self.accepted_tokens
        self.draft_tokens, self.accepted_tokens = draft_tokens, accepted_tokens
        if self._window_asked < WINDOW_DRAFTS:
            return
        if self._window_accepted < MIN_ACCEPTANCE * self._window_asked:
            self._paused_rows = self._next_pause
            self._next_pause = min(2 * self._next_pause, MAX_PAUSE_ROWS)
        else:
            self._next_pause = FIRST_PAUSE_ROWS
        self._window_asked = self._window_accepted = 0


def may_draft(request: GenerationRequest) -> bool:
    """Whether a request's rows may carry drafts: not with a repetition, presence or frequency
    penalty, whose logits at a draft's position would depend on the drafts before it (the device
    refuses such rows), nor with a constraint, whose mask at a draft's position would depend on the
    drafts before it (the device masks one entry per constrained row)."""
    sampling = request.sampling
    penalised = sampling.repetition_penalty != 1.0 or sampling.presence_penalty != 0.0 or sampling.frequency_penalty != 0.0
    return not penalised and request.constraint is None
