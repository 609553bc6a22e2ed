"""Prompt lookup (the ``ngram`` proposer's rule), on the host, one token at a time.

The device's `stageserve.device.speculation.proposer.NgramProposer` drafts, for each decode row, the tokens
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
    occurred: the index of the token after it (``MAX_N`` dict updates per token appended,
    ``MAX_N - MIN_N + 1`` entries held per token).

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
            for n, key in self._suffix_keys(end):
                self._follow[n - MIN_N][key] = end
            self.tokens.append(token)

    def propose(self, num_drafts: int) -> list[int]:
        """Up to ``num_drafts`` drafts after the last token: what followed the latest earlier
        occurrence of the longest suffix of ``MIN_N..MAX_N`` tokens that occurred, as far as known;
        ``[]`` without a match."""
        length = len(self.tokens)
        for n, key in reversed(self._suffix_keys(length)):  # the longest first
            # An earlier occurrence needs a token after it, before the suffix's end: n < length.
            at = self._follow[n - MIN_N].get(key) if n < length else None
            if at is not None:
                return self.tokens[at : min(at + num_drafts, length)]
        return []

    def _suffix_keys(self, end: int) -> list[tuple[int, int]]:
        """``(n, key)`` of the ``n``-grams ending before index ``end``, ``MIN_N <= n <= MAX_N`` as far
        as the tokens go; a key packs the tokens into one int (32 bits each, built from the last
        token back): a smaller dict key than a tuple, and no slice per ``n``."""
        keys, key = [], 0
        for n in range(1, min(MAX_N, end) + 1):
            key |= self.tokens[end - n] << (32 * (n - 1))
            if n >= MIN_N:
                keys.append((n, key))
        return keys
