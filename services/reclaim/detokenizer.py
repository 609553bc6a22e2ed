"""Incremental detokenization: token ids in, complete UTF-8 characters out, one sequence at a time.

The technique is the prefix/read-offset window of Hugging Face TGI's ``decode_token``
(``server/text_generation_server/models/model.py``) and vLLM's ``detokenize_incrementally``
(``vllm/transformers_utils/detokenizer_utils.py``): decode a short window of ids twice, once up to
the last emitted token (``prefix_text``) and once including the new ones (``new_text``), and emit
the difference. Decoding a window instead of single tokens keeps tokenizer context (leading-space
rules of SentencePiece/Metaspace decoders, byte-level merges); the window restarts at the last
emitted token, so each step costs O(new tokens), not O(sequence). A decode that ends in U+FFFD
means the new bytes end inside a multi-byte character: nothing is emitted and the window grows
until the character is complete, so a split character is never shown as U+FFFD and never emitted
twice.

Special tokens (EOS, chat markers) are skipped, as in vLLM's default ``skip_special_tokens=True``;
no ``clean_up_tokenization_spaces`` is applied (it is not defined on a text delta).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

from tokenizers import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens kept as left context of the first window (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): enough for any decoder's leading-space rule.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"

Decode = Callable[[Sequence[int]], str]


@dataclass
class DetokenizerState:
    """Per-sequence detokenization state.

    ``ids`` holds at most :data:`PROMPT_CONTEXT_TOKENS` prompt tokens followed by every generated
    token. ``ids[prefix_offset:read_offset]`` is the context already emitted; ``ids[read_offset:]``
    are tokens whose text is not emitted yet (an incomplete UTF-8 character).
    """

    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    @property
    def pending(self) -> bool:
        """Whether tokens wait for the rest of a character (their text is not emitted yet)."""
        return self.read_offset < len(self.ids)


def decoder_for(tokenizer: PreTrainedTokenizerBase | Tokenizer) -> Decode:
    """The fastest exact ``ids -> str`` decode of ``tokenizer`` (a transformers tokenizer, or the Rust
    ``tokenizers.Tokenizer`` reclaim loads: ``stageserve.tokenizer.load_fast_tokenizer``), skipping special tokens.

    Uses the Rust ``tokenizers`` backend directly when the tokenizer has one (about 3x faster than
    ``tokenizer.decode``, which adds Python layers per call), else ``tokenizer.decode``. Both give
    the text of ``tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)``.
    """
    backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    """Turns each sequence's new token ids into text deltas of complete characters.

    Args:
        decode: ``ids -> str`` (see :func:`decoder_for`); shared by all sequences.

    The concatenation of every delta of a sequence, plus :meth:`flush` at its end, equals
    ``decode(generated_ids)`` (given the prompt context, as a continuation of the prompt's text).
    """

    def __init__(self, decode: Decode) -> None:
        self._decode = decode

    @staticmethod
    def start(prompt_token_ids: Sequence[int]) -> DetokenizerState:
        """State for a new sequence whose prompt was ``prompt_token_ids`` (only its tail is kept)."""
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        return DetokenizerState(ids=context, prefix_offset=0, read_offset=len(context))

    def step(self, state: DetokenizerState, token_id: int) -> str:
        """Append one generated token; return the newly completed text ("" while a character is incomplete)."""
        state.ids.append(token_id)
        window = state.ids[state.prefix_offset :]
        prefix_text = self._decode(window[: state.read_offset - state.prefix_offset])
        new_text = self._decode(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        state.prefix_offset = state.read_offset
        state.read_offset = len(state.ids)
        return new_text[len(prefix_text) :]

    def flush(self, state: DetokenizerState) -> str:
        """Text of tokens held back at the end of a sequence.

        Held back are only tokens that end inside a multi-byte character. The complete characters
        among them are returned; the incomplete final character is dropped (``decode`` of all ids
        would show it as U+FFFD): its token ids are still reported, the text has no U+FFFD for it.
        """
        if state.read_offset == len(state.ids):
            return ""
        window = state.ids[state.prefix_offset :]
        prefix_text = self._decode(window[: state.read_offset - state.prefix_offset])
        state.prefix_offset = state.read_offset = len(state.ids)
        return self._decode(window)[len(prefix_text) :].rstrip(REPLACEMENT_CHAR)
