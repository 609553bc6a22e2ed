"""Speculative decoding (n-gram prompt lookup) end to end, through three real service processes.

The reference is a pipeline without speculation: with the same request (and seed) the
speculative pipeline must return the same tokens, at temperature 0 and above (the verification
draws the target's token with the same per-output-index noise), with every finish cut at the same
token. Speculation must also actually happen: the repetitive prompts get drafts accepted.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from stageserve.v1 import prepare_pb2, prepare_pb2_grpc

from .conftest import launch
from .test_generation_api import ABORT, chat, collect, wait_kv_all_free
from .test_observability import metric, scrape

SPECULATIVE = ["--speculative-method", "ngram", "--num-speculative-tokens", "3"]
PASSAGE = "The quick brown fox jumps over the lazy dog near the quiet river bank."
REPEAT = f"Repeat this sentence exactly, twice: {PASSAGE}"
PROMPTS = [REPEAT, "Count from 1 to 15, separated by commas.", "What is the capital of France?"]


# A loaded shared machine can take seconds per step: the comparison is of tokens, never of time.
pytestmark = pytest.mark.timeout(1800)  # three pipelines start in this module
PATIENT = dict(prepare_args=["--stall-timeout", "600"], reclaim_args=["--completion-timeout", "600"])


def start(tmp_path_factory, name: str, *device_args: str):
    """Yield (pipeline, Generation stub); stop the pipeline afterwards."""
    started = launch(tmp_path_factory, name, device_args=list(device_args), **PATIENT)
    try:
        with grpc.insecure_channel(started.prepare.address) as channel:
            yield started, prepare_pb2_grpc.GenerationStub(channel)
    finally:
        started.stop()


@pytest.fixture(scope="module")
def speculative(tmp_path_factory):
    """(pipeline, Generation stub) with n-gram speculation, async dispatch."""
    yield from start(tmp_path_factory, "speculative-async", *SPECULATIVE)


@pytest.fixture(scope="module")
def generation(tmp_path_factory):
    """The reference: a Generation stub on a pipeline without speculation."""
    for _, stub in start(tmp_path_factory, "speculative-reference"):
        yield stub


def generate(stub, prompt: str, **fields) -> prepare_pb2.GenerateResponse:
    fields.setdefault("max_tokens", 24)
    return stub.Generate(chat(prompt, **fields))


_references: dict[tuple, prepare_pb2.GenerateResponse] = {}


def reference(generation, prompt: str, **fields) -> prepare_pb2.GenerateResponse:
    """The non-speculative pipeline's response (each request generated once per session)."""
    key = (prompt, tuple(sorted((name, str(value)) for name, value in fields.items())))
    if key not in _references:
        _references[key] = generate(generation, prompt, **fields)
    return _references[key]


def test_greedy_output_equals_the_non_speculative_one_and_drafts_are_accepted(generation, speculative):
    _, stub = speculative
    accepted = {}
    for prompt in PROMPTS:
        expected, result = reference(generation, prompt, temperature=0.0), generate(stub, prompt, temperature=0.0)
        assert list(result.token_ids) == list(expected.token_ids), prompt
        assert result.text == expected.text and result.finish_reason == expected.finish_reason
        assert expected.usage.draft_tokens == 0
        assert 0 <= result.usage.accepted_tokens <= result.usage.draft_tokens
        accepted[prompt] = result.usage.accepted_tokens
    assert accepted[REPEAT] >= 5, accepted  # the passage is copied from the prompt


def test_sampled_output_with_a_seed_equals_the_non_speculative_one(generation, speculative):
    _, stub = speculative
    request = dict(temperature=0.8, top_p=0.95, seed=1234)
    expected, first, second = reference(generation, PROMPTS[1], **request), generate(stub, PROMPTS[1], **request), generate(stub, PROMPTS[1], **request)
    assert list(first.token_ids) == list(second.token_ids) == list(expected.token_ids)


def test_stop_string_stop_token_and_max_tokens_inside_a_run_cut_where_the_plain_run_does(generation, speculative):
    _, stub = speculative
    _, ids, chunks = collect(stub.GenerateStream(chat(REPEAT, temperature=0.0, max_tokens=24)))
    assert max(len(c.token_ids) for c in chunks) >= 2  # some step published an accepted run
    words = PASSAGE.split()
    cases = [dict(stop=[f" {words[5]} {words[6]}"]), dict(stop_token_ids=[ids[5]]), dict(max_tokens=len(ids) - 3)]
    for case in cases:
        request = dict(temperature=0.0, **case)
        expected, result = reference(generation, REPEAT, **request), generate(stub, REPEAT, **request)
        assert list(result.token_ids) == list(expected.token_ids), case
        assert (result.text, result.finish_reason, result.stop_string) == (expected.text, expected.finish_reason, expected.stop_string), case
        assert result.usage.completion_tokens == len(result.token_ids) < len(ids)


def test_a_batch_of_rows_with_different_acceptance_matches_each_alone(generation, speculative):
    _, stub = speculative
    expected = [list(reference(generation, prompt, temperature=0.0).token_ids) for prompt in PROMPTS]
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:
        results[i] = list(generate(stub, PROMPTS[i], temperature=0.0).token_ids)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [results[i] for i in range(len(PROMPTS))] == expected


def test_logprobs_are_those_of_the_plain_run(generation, speculative):
    _, stub = speculative
    request = dict(temperature=0.0, logprobs=2, max_tokens=12)
    expected, result = reference(generation, REPEAT, **request), generate(stub, REPEAT, **request)
    assert [lp.token_id for lp in result.logprobs] == list(expected.token_ids) and result.usage.accepted_tokens > 0
    for mine, theirs in zip(result.logprobs, expected.logprobs):
        assert list(mine.top_token_ids) == list(theirs.top_token_ids)
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-3)


def test_abort_mid_generation_frees_kv_and_metrics_count_acceptance(speculative):
    pipeline, stub = speculative
    stream = stub.GenerateStream(chat(REPEAT, temperature=0.0, max_tokens=200, ignore_eos=True, request_id="spec-abort"))
    next(stream)
    assert stub.Abort(prepare_pb2.AbortRequest(request_id="spec-abort")).aborted
    assert list(stream)[-1].finish_reason == ABORT
    wait_kv_all_free(stub)
    samples = scrape(pipeline.device)
    drafted, accepted = metric(samples, "stageserve_spec_draft_tokens_total"), metric(samples, "stageserve_spec_accepted_tokens_total")
    assert 0 < accepted <= drafted
    assert metric(samples, "stageserve_spec_position_accepted_total", position="0") > 0


def test_sync_dispatch_gives_the_same_tokens(tmp_path_factory, generation):
    for _, stub in start(tmp_path_factory, "speculative-sync", *SPECULATIVE, "--dispatch", "sync"):
        for prompt in PROMPTS[:2]:
            assert list(generate(stub, prompt, temperature=0.0).token_ids) == list(reference(generation, prompt, temperature=0.0).token_ids)



def test_a_constrained_request_on_a_speculating_device_is_valid_and_never_drafts(speculative):
    """Structured output composes with speculation: a constrained row asks for no drafts (its mask
    at a draft's position would depend on the drafts before it), its one entry is masked; an
    unconstrained request in the same steps still gets drafts accepted."""
    _, stub = speculative
    options = ["alpha", "beta", "gamma"]
    constrained = chat("Pick one of alpha, beta, gamma.", max_tokens=8, temperature=1.0, seed=3)
    constrained.constraint.choice.options.extend(options)
    free = chat(REPEAT, max_tokens=24, temperature=0.0)
    results: dict[str, prepare_pb2.GenerateResponse] = {}
    threads = [threading.Thread(target=lambda key=key, request=request: results.__setitem__(key, stub.Generate(request)))
               for key, request in (("constrained", constrained), ("free", free))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results["constrained"].text in options
    assert results["constrained"].usage.draft_tokens == 0
    assert results["free"].usage.accepted_tokens > 0
