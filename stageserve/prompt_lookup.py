"""Prompt lookup (the ``ngram`` proposer's rule), on the host, one token at a time.

The device's `stageserve.device.proposer.NgramProposer` drafts, for each decode row, the tokens
that followed the latest earlier occurrence of the sequence's last ``n`` tokens, for the longest
``n`` in ``[MIN_N, MAX_N]`` that occurs (vLLM's ``ngram`` method, Hugging Face's prompt-lookup
decoding), vectorised over the rows on the device. `PromptLookup` is the same rule kept
incrementally over one sequence's tokens, for prepare's draft planner to replay what the device
would have drafted at every row, drafting or not (`stageserve.prepare.draft_planner`);
tests/unit/device/test_speculative.py checks that the two agree.
"""

from __future__ import annotations

MIN_N = 1  # the shortest suffix looked up
MAX_N = 3  # the longest


class PromptLookup:
    """One sequence's tokens and, per ``n``, where each ``n``-gram that something followed last
    occurred: the index of the token after it (O(1) per token, ``MAX_N - MIN_N + 1`` entries per
    token held).

    Args:
        tokens: the sequence so far (its prompt); token ids are int32 (as on the wire).
    """

    def __init__(self, tokens: list[int]) -> None:
        self.tokens: list[int] = []
        self._follow: list[dict[int, int]] = [{} for _ in range(MIN_N, MAX_N + 1)]  # per n: n-gram key -> index after it
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens``: each one is what followed the ``n``-grams ending just before it."""
        for token in tokens:
            end = len(self.tokens)
            for n, follow in zip(range(MIN_N, MAX_N + 1), self._follow):
                if end >= n:
                    follow[self._key(end - n, n)] = end
            self.tokens.append(token)

    def propose(self, num_drafts: int) -> list[int]:
        """Up to ``num_drafts`` drafts after the last token: what followed the latest earlier
        occurrence of the longest suffix of ``MIN_N..MAX_N`` tokens that occurred, as far as known;
        ``[]`` without a match."""
        length = len(self.tokens)
        for n in range(MAX_N, MIN_N - 1, -1):
            if length > n:  # an earlier occurrence needs a token after it, before the suffix's end
                at = self._follow[n - MIN_N].get(self._key(length - n, n))
                if at is not None:
                    return self.tokens[at : min(at + num_drafts, length)]
        return []

    def _key(self, start: int, n: int) -> int:
        """Tokens ``[start, start + n)`` packed into one int (32 bits each): a smaller dict key than a tuple."""
        key = 0
        for token in self.tokens[start : start + n]:
            key = key << 32 | token
        return key
