"""The public Generation API end to end, through three real service processes on loopback."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from stageserve.v1 import common_pb2, prepare_pb2

from .conftest import MAX_MODEL_LEN

STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT


def chat(text: str, **fields) -> prepare_pb2.GenerateRequest:
    return prepare_pb2.GenerateRequest(messages=[prepare_pb2.ChatMessage(role="user", content=text)], **fields)


def collect(stream) -> tuple[str, list[int], list[prepare_pb2.GenerateStreamResponse]]:
    chunks = list(stream)
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks


def kv_free(generation) -> tuple[int, int]:
    info = generation.GetModelInfo(prepare_pb2.GetModelInfoRequest())
    return info.kv_blocks_free, info.kv_blocks_total


def wait_kv_all_free(generation, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, total = kv_free(generation)
        if free == total:
            return
        time.sleep(0.05)
    assert kv_free(generation)[0] == kv_free(generation)[1], "KV blocks did not return to the pool"


def test_chat_capital_of_france_streams_paris(generation):
    """Greedy chat answer names Paris, ends with STOP, and usage counts the streamed token ids."""
    text, ids, chunks = collect(generation.GenerateStream(chat("What is the capital of France?", temperature=0.0)))
    final = chunks[-1]
    assert "Paris" in text
    assert final.finish_reason == STOP
    assert final.stop_token_id == 2  # <|im_end|>, the model's EOS
    assert final.usage.completion_tokens == len(ids)
    assert final.usage.prompt_tokens == len(generation.Tokenize(prepare_pb2.TokenizeRequest(messages=[prepare_pb2.ChatMessage(role="user", content="What is the capital of France?")])).token_ids)
    assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])


def test_unary_and_stream_agree(generation):
    """Generate and GenerateStream return the same text and ids for the same greedy request."""
    request = chat("Name three colours.", temperature=0.0, max_tokens=24)
    unary = generation.Generate(request)
    text, ids, chunks = collect(generation.GenerateStream(request))
    assert unary.text == text and list(unary.token_ids) == ids
    assert unary.finish_reason == chunks[-1].finish_reason
    assert unary.usage.completion_tokens == len(ids)


PROMPTS = [
    "Write a haiku about the sea.", "What is 2 + 2?", "Name a famous painter.", "Describe a cat in one sentence.",
    "What is the boiling point of water?", "Give me a synonym for happy.", "Who wrote Hamlet?", "List two planets.",
    "What colour is the sky?", "Translate 'thank you' to French.", "What is a prime number?", "Say hello politely.",
    "What do bees make?", "Name a programming language.", "How many legs does a spider have?", "What is the largest ocean?",
]


def test_sixteen_concurrent_streams_match_solo_runs(generation):
    """16 concurrent greedy streams: no lost, duplicated or mixed tokens; each matches its solo run
    for at least its first 16 tokens; usage equals the ids streamed."""
    solo = {p: collect(generation.GenerateStream(chat(p, temperature=0.0, max_tokens=32)))[1] for p in PROMPTS}
    results: dict[str, tuple[str, list[int], list]] = {}

    def one(prompt: str) -> None:
        results[prompt] = collect(generation.GenerateStream(chat(prompt, temperature=0.0, max_tokens=32)))

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert set(results) == set(PROMPTS)
    for prompt, (text, ids, chunks) in results.items():
        assert chunks[-1].usage.completion_tokens == len(ids), prompt
        assert chunks[-1].finish_reason in (STOP, LENGTH)
        n = min(16, len(solo[prompt]))
        assert ids[:n] == solo[prompt][:n], prompt
        assert {c.request_id for c in chunks} == {chunks[0].request_id}


def test_stop_string_across_token_boundary(generation):
    """A stop string spanning token boundaries ends the stream; the client never sees any of it."""
    base = chat("What is the capital of France?", temperature=0.0, max_tokens=40)
    text, ids, _ = collect(generation.GenerateStream(base))
    assert "capital of France" in text
    stop = "ital of Fr"  # spans the tokens " capital", " of" and " France"
    request = chat("What is the capital of France?", temperature=0.0, max_tokens=40, stop=[stop])
    stopped, stopped_ids, chunks = collect(generation.GenerateStream(request))
    assert stopped == text[: text.index(stop)]
    assert "ital" not in stopped
    assert chunks[-1].finish_reason == STOP and chunks[-1].stop_string == stop
    with_stop = collect(generation.GenerateStream(chat("What is the capital of France?", temperature=0.0, max_tokens=40, stop=[stop], include_stop_str_in_output=True)))[0]
    assert with_stop == text[: text.index(stop) + len(stop)]


@pytest.mark.parametrize("prompt", ["东京是日本的首都。北京是", "I love pizza 🍕🍕 and tacos 🌮. My favourite emoji is"])
def test_multibyte_characters_stream_whole(generation, tokenizer, prompt):
    """CJK and emoji stream as whole characters: no chunk holds U+FFFD, and the chunks concatenate
    to exactly the tokenizer's decoding of all streamed ids (nothing repeated or dropped)."""
    request = prepare_pb2.GenerateRequest(prompt=prompt, temperature=0.0, max_tokens=24, ignore_eos=True)
    text, ids, chunks = collect(generation.GenerateStream(request))
    assert len(ids) == 24
    assert all("\ufffd" not in c.text for c in chunks)
    assert text == tokenizer.decode(ids)
    assert any(ord(ch) > 0x2E80 for ch in text)  # the continuation really holds multi-byte characters


def test_max_tokens_one_and_ignore_eos(generation):
    one = generation.Generate(chat("Hi", temperature=0.0, max_tokens=1))
    assert len(one.token_ids) == 1 and one.finish_reason == LENGTH and one.usage.completion_tokens == 1
    long = generation.Generate(chat("Hi", temperature=0.0, max_tokens=40, ignore_eos=True))
    assert len(long.token_ids) == 40 and long.finish_reason == LENGTH


def prompt_of_length(generation, n: int) -> list[int]:
    """``n`` token ids: a sentence's, repeated (Tokenize refuses text longer than the context)."""
    ids = list(generation.Tokenize(prepare_pb2.TokenizeRequest(prompt="the quick brown fox jumps over the lazy dog ")).token_ids)
    return (ids * (n // len(ids) + 1))[:n]


def test_context_limits(generation):
    """prompt + max_tokens may reach the context exactly; one token over is INVALID_ARGUMENT."""
    ids = prompt_of_length(generation, MAX_MODEL_LEN - 8)
    full = generation.Generate(prepare_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=8, ignore_eos=True, temperature=0.0))
    assert len(full.token_ids) == 8 and full.finish_reason == LENGTH
    default = generation.Generate(prepare_pb2.GenerateRequest(prompt_token_ids=ids, ignore_eos=True, temperature=0.0))
    assert len(default.token_ids) == 8 and default.finish_reason == LENGTH  # default max_tokens = the remaining context
    at_limit = generation.Generate(prepare_pb2.GenerateRequest(prompt_token_ids=prompt_of_length(generation, MAX_MODEL_LEN - 1), max_tokens=1, temperature=0.0))
    assert len(at_limit.token_ids) == 1
    with pytest.raises(grpc.RpcError) as over:
        generation.Generate(prepare_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=9, temperature=0.0))
    assert over.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in over.value.details()
    with pytest.raises(grpc.RpcError) as whole:
        generation.Generate(prepare_pb2.GenerateRequest(prompt_token_ids=prompt_of_length(generation, MAX_MODEL_LEN), temperature=0.0))
    assert whole.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "fields, field_name",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt="hi", temperature=-1.0), "temperature"),
        (dict(prompt="hi", top_p=1.5), "top_p"),
        (dict(prompt="hi", top_p=0.0), "top_p"),
        (dict(prompt_token_ids=[1, 10**6]), "prompt_token_ids"),
        (dict(messages=[prepare_pb2.ChatMessage(role="wizard", content="hi")]), "role"),
        (dict(prompt="hi", max_tokens=0), "max_tokens"),
        (dict(prompt="hi", separate_reasoning=True), "--reasoning-parser"),  # this prepare runs without one
    ],
)
def test_bad_input_is_invalid_argument(generation, fields, field_name):
    with pytest.raises(grpc.RpcError) as error:
        generation.Generate(prepare_pb2.GenerateRequest(**fields))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in error.value.details()


def test_abort_mid_stream_frees_kv(generation):
    request = chat("Count from one to one hundred.", temperature=0.0, max_tokens=200, ignore_eos=True, request_id="abort-me")
    stream = generation.GenerateStream(request)
    first = next(stream)
    assert first.request_id == "abort-me"
    assert generation.Abort(prepare_pb2.AbortRequest(request_id="abort-me")).aborted
    rest = list(stream)
    assert rest[-1].finish_reason == ABORT
    assert not generation.Abort(prepare_pb2.AbortRequest(request_id="abort-me")).aborted  # idempotent
    wait_kv_all_free(generation)


def test_client_cancel_and_deadline_free_kv(generation):
    stream = generation.GenerateStream(chat("Count to a hundred.", max_tokens=200, ignore_eos=True))
    next(stream)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as cancelled:
        list(stream)
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    with pytest.raises(grpc.RpcError) as late:  # 200 tokens take ~1 s at one stream on the fastest CPU seen (a Zen 5)
        list(generation.GenerateStream(chat("Count to a hundred.", max_tokens=200, ignore_eos=True), timeout=0.25))
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_kv_all_free(generation)
