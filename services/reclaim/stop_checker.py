"""Stop conditions of one sequence: EOS and stop token ids, stop strings, ``max_tokens``.

Semantics (those of vLLM's ``check_stop`` / ``check_stop_strings``, except where noted):

- **Token ids.** The model's EOS ids (from ``Device.Attach``; skipped with ``ignore_eos``) and
  ``stop_token_ids`` finish the sequence with ``FINISH_REASON_STOP``. The stop token counts as a
  completion token and is in ``token_ids``; its text is published only with
  ``include_stop_str_in_output`` (special tokens such as EOS have no text anyway).
- **Stop strings** are matched in the text, across token boundaries. Text that could still grow
  into a stop string is held back, and released as soon as it cannot (stricter than vLLM, which
  always holds back ``max(len(stop)) - 1`` characters). On a match the text is cut before the stop
  string (after it with ``include_stop_str_in_output``) and everything after is dropped. When one
  token completes several stop strings, the one that ends first in the text wins.
- **min_tokens.** While a sequence has fewer than ``min_tokens`` completion tokens (this one
  included), EOS, stop token ids *and* stop strings are ignored, as in vLLM. A stop string that
  straddles that boundary (begins before, completes at or after the ``min_tokens``-th token) still
  matches, because the held-back tail is kept.
- **max_tokens.** Reaching it finishes with ``FINISH_REASON_LENGTH``, unless that same token also
  hit a stop token or stop string: the more specific ``STOP`` wins (vLLM reports ``LENGTH`` for a
  stop token on the last allowed position, ``STOP`` for a stop string).
"""

from __future__ import annotations

from typing import Collection

from stageserve.v1 import common_pb2


class StopChecker:
    """Stop conditions and held-back text of one sequence.

    Args:
        params: the sequence's ``StopParams`` (from its ``SequenceStart``).
        eos_token_ids: the model's EOS ids (``AttachReply.eos_token_ids``).

    Completion-token counts passed in include the token being checked.
    """

    __slots__ = ("max_tokens", "min_tokens", "include_stop_str_in_output", "_stop_ids", "_stops", "_held")

    def __init__(self, params: common_pb2.StopParams, eos_token_ids: Collection[int]) -> None:
        self.max_tokens = params.max_tokens
        self.min_tokens = params.min_tokens
        self.include_stop_str_in_output = params.include_stop_str_in_output
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(eos_token_ids)
        self._stop_ids = frozenset(stop_ids)
        self._stops = tuple(s for s in params.stop if s)  # "" would match everywhere
        self._held = ""  # text tail that could still become a stop string

    def stop_token(self, token_id: int, completion_tokens: int) -> int | None:
        """``token_id`` if it is an EOS/stop token id that finishes the sequence now, else ``None``."""
        if token_id in self._stop_ids and completion_tokens >= self.min_tokens:
            return token_id
        return None

    def scan(self, text: str, completion_tokens: int) -> tuple[str, str | None]:
        """Add a text delta; return ``(publishable text, matched stop string or None)``.

        Without a match the publishable text is the held tail plus ``text`` minus the longest
        suffix that is a proper prefix of some stop string (kept for the next call). With a match
        the text is cut at the stop string, and the sequence must finish.
        """
        if not self._stops:
            return text, None
        buffer = self._held + text
        if completion_tokens >= self.min_tokens:
            match = self._first_match(buffer)
            if match is not None:
                start, stop = match
                self._held = ""
                end = start + len(stop) if self.include_stop_str_in_output else start
                return buffer[:end], stop
        keep = self._partial_match_len(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], None

    @property
    def holding(self) -> bool:
        """Whether text is held back (it could still become a stop string)."""
        return bool(self._held)

    def release(self, text: str = "") -> str:
        """Held-back tail plus ``text``, for a sequence finishing for another reason than a stop string."""
        held, self._held = self._held, ""
        return held + text

    def length_reached(self, completion_tokens: int) -> bool:
        """Whether ``max_tokens`` completion tokens have been generated."""
        return completion_tokens >= self.max_tokens

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first in ``buffer`` (longest on a tie)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _partial_match_len(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:k]):
                    longest = k
                    break
        return longest
