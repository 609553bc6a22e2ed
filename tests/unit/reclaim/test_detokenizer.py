"""Incremental detokenization with the embedded model's real (byte-level BPE) tokenizer."""

from __future__ import annotations

import pytest

from stageserve.reclaim.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer

EOS = 2

TEXTS = [
    "Hello world, plain ASCII.",
    "日本語のテキストです。東京タワーは高い。",
    "Emoji: 😀🎉 and a family 👨‍👩‍👧 with a flag 🇯🇵.",
    "Mixed: café, naïve, Ελληνικά, русский, 中文 and 한국어 😀!",
]


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], prompt_ids: list[int] = ()) -> list[str]:
    state = detokenizer.start(list(prompt_ids))
    deltas = [detokenizer.step(state, token_id) for token_id in ids]
    return deltas + [detokenizer.flush(state)]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_has_whole_characters_and_concatenates_to_decode(tokenizer, detokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(detokenizer, ids)
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_split_character_is_emitted_once_when_complete(tokenizer, detokenizer):
    ids = tokenizer.encode("日本", add_special_tokens=False)
    assert len(ids) == 3  # '日' takes two byte-level tokens
    assert stream(detokenizer, ids) == ["", "日", "本", ""]


def test_prompt_context_continues_the_prompt_text(tokenizer, detokenizer):
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(chat, add_special_tokens=False)
    ids = tokenizer.encode("Hello! 😀 How can I help?", add_special_tokens=False)
    deltas = stream(detokenizer, ids, prompt)
    assert "".join(deltas) == "Hello! 😀 How can I help?"


def test_special_tokens_are_skipped(tokenizer, detokenizer):
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [EOS] + tokenizer.encode(" there", add_special_tokens=False)
    assert "".join(stream(detokenizer, ids)) == "Hi there"


def test_sequence_ending_inside_a_character_drops_that_character(tokenizer, detokenizer):
    """Issue 20: max_tokens may end inside a multi-byte character; the text ends before it, no U+FFFD."""
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # drop the emoji's last byte token
    deltas = stream(detokenizer, ids)
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd") == "ok "


def test_window_stays_short_on_long_sequences(tokenizer, detokenizer):
    ids = tokenizer.encode("東京タワーは😀です。" * 40, add_special_tokens=False)
    state = detokenizer.start(tokenizer.encode("prompt text here", add_special_tokens=False))
    assert len(state.ids) <= PROMPT_CONTEXT_TOKENS
    widest = 0
    for token_id in ids:
        detokenizer.step(state, token_id)
        widest = max(widest, len(state.ids) - state.prefix_offset)
    assert widest <= 8  # the window spans one character's tokens plus the last emitted token, not the sequence
