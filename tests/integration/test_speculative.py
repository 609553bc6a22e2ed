"""Speculative decoding end to end, through three real service processes, with each proposer:
n-gram prompt lookup, and a draft model (the target itself, so that every greedy draft is right).

The reference is the session's shared pipeline without speculation (conftest's ``generation``):
with the same request (and seed) the speculative pipeline must return the same tokens, at
temperature 0 and above (the verification draws the target's token with the same per-output-index
noise), with every finish cut at the same token. Speculation must also actually happen: the
repetitive prompts get drafts accepted.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from stageserve.model_files import embedded_model_path
from stageserve.v1 import prepare_pb2, prepare_pb2_grpc

from tests.tiny_checkpoint import add_mtp_layer, write_tiny_checkpoint

from .conftest import MAX_MODEL_LEN, launch
from .test_generation_api import ABORT, chat, collect, wait_kv_all_free
from .test_observability import metric, scrape

# `always`: every decode row drafts, so that these tests see drafts whatever this machine's step
# costs are (the default plans them by cost: test_the_goodput_policy_...).
ALWAYS = ["--speculative-policy", "always"]
METHODS = {
    "ngram": ["--speculative-method", "ngram", "--num-speculative-tokens", "3", *ALWAYS],
    # The target as its own draft model: a draft is the target's greedy token, so at temperature 0 all are accepted.
    "draft": ["--speculative-method", "draft", "--draft-model", str(embedded_model_path()), "--num-speculative-tokens", "3", *ALWAYS],
}
PASSAGE = "The quick brown fox jumps over the lazy dog near the quiet river bank."
REPEAT = f"Repeat this sentence exactly, twice: {PASSAGE}"
PROMPTS = [REPEAT, "Count from 1 to 15, separated by commas.", "What is the capital of France?"]


# A loaded shared machine can take seconds per step: the comparison is of tokens, never of time.
pytestmark = pytest.mark.timeout(1800)  # five pipelines start in this module
PATIENT = dict(prepare_args=["--stall-timeout", "600"], reclaim_args=["--completion-timeout", "600"])


def start(tmp_path_factory, name: str, *device_args: str, model: str = ""):
    """Yield (pipeline, Generation stub) of ``model`` (default: the embedded one); stop the pipeline afterwards."""
    model_args = ["--model", model] if model else []
    started = launch(tmp_path_factory, name, device_args=[*model_args, *device_args], prepare_args=[*PATIENT["prepare_args"], *model_args],
                     reclaim_args=[*PATIENT["reclaim_args"], *model_args])
    try:
        with grpc.insecure_channel(started.prepare.address) as channel:
            yield started, prepare_pb2_grpc.GenerationStub(channel)
    finally:
        started.stop()


@pytest.fixture(scope="module", params=list(METHODS))
def method(request) -> str:
    """The proposer the speculative pipeline runs (each test using it runs once per method)."""
    return request.param


@pytest.fixture(scope="module")
def speculative(tmp_path_factory, method):
    """(pipeline, Generation stub) speculating with ``method``, async dispatch."""
    yield from start(tmp_path_factory, f"speculative-{method}-async", *METHODS[method])


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


@pytest.mark.parametrize("request_fields", [dict(temperature=0.8, top_p=0.95, seed=1234), dict(temperature=1.0, seed=77)], ids=["t0.8", "t1.0"])
def test_sampled_output_with_a_seed_equals_the_non_speculative_one(generation, speculative, request_fields):
    _, stub = speculative
    expected = reference(generation, PROMPTS[1], **request_fields)
    first, second = generate(stub, PROMPTS[1], **request_fields), generate(stub, PROMPTS[1], **request_fields)
    assert list(first.token_ids) == list(second.token_ids) == list(expected.token_ids)
    assert first.usage.draft_tokens > 0


def test_the_target_as_its_own_draft_model_has_every_greedy_draft_accepted(generation, method, request):
    """Each prompt twice: the second time its full prompt blocks come from the prefix cache, where
    the first request's prefill wrote the draft model's KV too. ``ignore_eos``: no finish falls
    inside a run, where reclaim would count the drafts after it as drafted but not accepted."""
    if method != "draft":
        pytest.skip("a draft-model property")
    _, stub = request.getfixturevalue("speculative")  # only now: the skip starts no pipeline
    fields = dict(temperature=0.0, ignore_eos=True, max_tokens=24)
    for prompt in PROMPTS[:2]:
        expected = reference(generation, prompt, **fields)
        results = [generate(stub, prompt, **fields) for _ in range(2)]
        assert results[1].usage.cached_tokens > 0
        for result in results:
            assert list(result.token_ids) == list(expected.token_ids), prompt
            assert result.usage.draft_tokens == result.usage.accepted_tokens > 0, prompt


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
    """With the n-gram proposer only: how the executor waits for a step does not depend on which
    proposer made its drafts (a draft-model sync pipeline added two model loads and nothing else)."""
    for _, stub in start(tmp_path_factory, "speculative-ngram-sync", *METHODS["ngram"], "--dispatch", "sync"):
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


def test_a_draft_model_that_is_often_wrong_leaves_the_tokens_exact(tmp_path_factory):
    """Tiny checkpoints with one tokenizer: the target, and a one-layer draft model of other weights
    (another path: the device compares the tokenizers and accepts). Drafts get rejected; the tokens
    are the non-speculative run's, greedy and seeded. The two pipelines run side by side (each
    serves its requests one at a time, as alone)."""
    target = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-target"))
    draft = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-draft"), seed=1, num_layers=1)
    requests = [prepare_pb2.GenerateRequest(prompt=prompt, max_tokens=32, ignore_eos=True, **fields)
                for prompt in ("abcabcabc", "Hello, world") for fields in (dict(temperature=0.0), dict(temperature=1.0, seed=5))]

    def serve(name: str, *flags: str) -> list[prepare_pb2.GenerateResponse]:
        for _, stub in start(tmp_path_factory, f"tiny-{name}", *flags, model=str(target)):
            responses = [stub.Generate(request) for request in requests]
        return responses

    with ThreadPoolExecutor(2) as pool:
        plain, speculating = pool.submit(serve, "plain"), pool.submit(serve, "draft", "--speculative-method", "draft", "--draft-model", str(draft), *ALWAYS)
        results = {"plain": plain.result(), "draft": speculating.result()}
    assert [list(r.token_ids) for r in results["draft"]] == [list(r.token_ids) for r in results["plain"]]
    drafted, accepted = (sum(getattr(r.usage, field) for r in results["draft"]) for field in ("draft_tokens", "accepted_tokens"))
    assert 0 <= accepted < drafted


def test_the_checkpoints_mtp_layer_drafts_and_leaves_the_tokens_exact(tmp_path_factory):
    """``--speculative-method mtp`` on tiny DeepSeek-V3 checkpoints with a multi-token-prediction
    layer: a random one leaves the tokens the non-speculative run's, greedy and seeded; one that
    copies its one-layer target has every greedy draft accepted, counted per position in the
    device's metrics and in each response's usage. The three pipelines run side by side."""
    target = add_mtp_layer(write_tiny_checkpoint(tmp_path_factory.mktemp("v3-mtp"), family="deepseek_v3"))
    copied = write_tiny_checkpoint(tmp_path_factory.mktemp("v3-copy"), family="deepseek_v3", num_layers=1, overrides={"first_k_dense_replace": 0})
    add_mtp_layer(copied, copy_target=True)
    requests = [prepare_pb2.GenerateRequest(prompt=prompt, max_tokens=32, ignore_eos=True, **fields)
                for prompt in ("abcabcabc", "Hello, world") for fields in (dict(temperature=0.0), dict(temperature=1.0, seed=5))]
    mtp = ("--speculative-method", "mtp", "--num-speculative-tokens", "3", *ALWAYS)

    def serve(name: str, model: Path, *flags: str) -> tuple[list[prepare_pb2.GenerateResponse], dict]:
        for pipeline, stub in start(tmp_path_factory, f"tiny-{name}", *flags, model=str(model)):
            responses = [stub.Generate(request) for request in requests]
            samples = scrape(pipeline.device)
        return responses, samples

    with ThreadPoolExecutor(3) as pool:
        runs = {name: pool.submit(serve, name, *args) for name, args in
                (("v3-plain", (target,)), ("v3-mtp", (target, *mtp)), ("v3-copy", (copied, *mtp)))}
        (plain, _), (speculating, _), (copy, samples) = (runs[name].result() for name in ("v3-plain", "v3-mtp", "v3-copy"))
    assert [list(r.token_ids) for r in speculating] == [list(r.token_ids) for r in plain]
    assert sum(r.usage.draft_tokens for r in speculating) > 0
    for response in copy[::2]:  # greedy: every draft is the target's token
        assert response.usage.draft_tokens > 0 and response.usage.accepted_tokens == response.usage.draft_tokens
    drafted = [metric(samples, "stageserve_spec_position_drafted_total", position=str(j)) for j in range(3)]
    accepted = [metric(samples, "stageserve_spec_position_accepted_total", position=str(j)) for j in range(3)]
    assert all(count > 0 for count in drafted) and all(0 < a <= d for a, d in zip(accepted, drafted))
    assert metric(samples, "stageserve_spec_accepted_tokens_total") == sum(r.usage.accepted_tokens for r in copy)


def test_mtp_on_a_checkpoint_without_mtp_layers_exits_with_code_2(tmp_path):
    code, errors = device_exit("--model", str(write_tiny_checkpoint(tmp_path / "v3", family="deepseek_v3")), "--speculative-method", "mtp")
    assert code == 2 and len(errors) == 1, errors
    assert "--speculative-method mtp needs multi-token-prediction layers, and the checkpoint has none" in errors[0]
    assert "choose --speculative-method ngram or draft" in errors[0]


def test_the_goodput_policy_measures_step_costs_plans_drafts_by_them_and_keeps_the_tokens_exact(tmp_path_factory, generation):
    """The default policy: the device measures its decode-step costs at start-up (logged) and
    prepare gives a row the drafts its acceptance pays for. Which rows draft depends on this
    machine's costs at start-up (tests/unit/prepare/test_draft_planner.py checks the choice for
    given costs); the tokens never do."""
    for pipeline, stub in start(tmp_path_factory, "speculative-goodput", "--speculative-method", "ngram", "--num-speculative-tokens", "3"):
        fields = dict(temperature=0.0, max_tokens=48)
        results = {prompt: generate(stub, prompt, **fields) for prompt in (REPEAT, PROMPTS[2])}
        log = pipeline.device.log_path.read_text()
    costs = re.search(r"decode step costs \(ms, rows x drafts per row @ context tokens\): (.*)", log)
    long = MAX_MODEL_LEN - 4 * (1 + 2 + 3 + 4) - 1  # --max-model-len allows this much context beside the measured steps
    assert costs and all(f"{point} " in costs.group(1) for point in ("1x0@8", "1x3@8", "8x3@8", f"8x0@{long}", f"8x3@{long}")), log[-3000:]
    for prompt, result in results.items():
        assert list(result.token_ids) == list(reference(generation, prompt, **fields).token_ids), prompt
        assert 0 <= result.usage.accepted_tokens <= result.usage.draft_tokens


def device_exit(*flags: str) -> tuple[int, list[str]]:
    """Run a device service with ``flags`` until it exits: (exit code, its ERROR log lines)."""
    finished = subprocess.run([sys.executable, "-m", "stageserve", "device", "--port", "0", "--metrics-port", "off", *flags],
                              capture_output=True, text=True, timeout=300)
    return finished.returncode, [line for line in finished.stderr.splitlines() if " ERROR " in line]


@pytest.mark.parametrize("flags, says", [
    (["--speculative-method", "draft"], "--speculative-method draft needs --draft-model"),
    (["--speculative-method", "ngram", "--draft-model", "draft.gguf"], "add --speculative-method draft or drop --draft-model"),
    (["--draft-model", "draft.gguf"], "add --speculative-method draft or drop --draft-model"),
])
def test_draft_model_flags_that_do_not_fit_exit_with_code_2_saying_what_to_change(flags, says):
    code, errors = device_exit(*flags)
    assert code == 2 and len(errors) == 1 and says in errors[0], errors
    launcher = subprocess.run([sys.executable, "-m", "stageserve", "up", *flags], capture_output=True, text=True, timeout=120)
    assert launcher.returncode == 2 and says in launcher.stderr


def test_a_draft_model_with_another_vocabulary_exits_with_code_2(tmp_path):
    """The tiny checkpoint's 257 byte tokens against the embedded model's vocabulary."""
    tiny = write_tiny_checkpoint(tmp_path / "tiny")
    code, errors = device_exit("--model", str(tiny), "--speculative-method", "draft", "--draft-model", str(embedded_model_path()))
    assert code == 2 and len(errors) == 1, errors
    assert "--draft-model" in errors[0] and "its tokenizer has 49152 tokens, --model's has 257" in errors[0]
    assert "choose a draft model that shares the target's tokenizer" in errors[0]
