"""What the device's prompt lookup would have drafted at each published decode row, and how much of it
the target would have accepted, whether or not the row asked for drafts.

Exact verification makes the counterfactual exact: a speculating row emits the very tokens the
non-speculative run emits (``device/speculation/verification.py``: the target's token at each position is drawn
with noise keyed by the sequence's seed and output index, at any temperature), and a draft is
accepted iff it equals the target's token at its position. So once the tokens after a row are
published, the drafts prompt lookup proposes from the tokens before it (`stageserve.prompt_lookup`,
the device's ``ngram`` rule) would have been accepted exactly as far as they agree with them. The
draft planner learns from every row this way, instead of from drafting rows only, at no device cost
(no probing, no draft run to find out that it would have been rejected).

The replay needs the tokens up to ``K`` after a row: its observation comes that many tokens later.
"""

from __future__ import annotations

from collections import deque

from stageserve.prompt_lookup import PromptLookup


class DraftReplay:
    """One sequence's replay of prompt lookup with ``num_drafts`` (K) drafts per row.

    Args:
        prompt: the sequence's prompt token ids.
        num_drafts: K.
    """

    def __init__(self, prompt: list[int], num_drafts: int) -> None:
        self.lookup = PromptLookup(prompt)
        self.num_drafts = num_drafts
        self._pending: deque[tuple[int, list[int]]] = deque()  # (index of the row's first new token, its drafts)

    def publish(self, tokens: list[int], decode_row: bool) -> list[tuple[int, int]]:
        """Take a published row's ``tokens`` (``decode_row``: a decode row, whose drafts are
        replayed; else a prompt row's first token). Returns ``(proposed, accepted)`` of each earlier
        row whose drafts can now be judged: drafts prompt lookup makes there (``<= K``), and how many
        of them, in order, equal the tokens that followed."""
        history = self.lookup.tokens
        if decode_row:
            self._pending.append((len(history), self.lookup.propose(self.num_drafts)))
        self.lookup.extend(tokens)
        judged = []
        while self._pending and len(history) >= self._pending[0][0] + len(self._pending[0][1]):
            start, drafts = self._pending.popleft()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == history[start + accepted]:
                accepted += 1
            judged.append((len(drafts), accepted))
        return judged
