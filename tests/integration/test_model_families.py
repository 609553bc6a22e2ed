"""The families added through ``services/device/model/README.md`` served through the three services:
Qwen3, Mistral with a sliding window shorter than the prompts, and Gemma 2 and Gemma 3 with such a
window on their local layers beside global ones (Gemma 2 soft-capped), Qwen3-MoE (a dense layer and a
mixture of experts: batched rows routed to different experts) and DeepSeek-V3 (latent attention over a
pool of latents, read back by a prefix-cache hit; grouped sigmoid routing and shared experts); one
pipeline each. DeepSeek-V2 differs from V3 only in what loads and in its router, checked in the unit tests. Phi-3 differs
only in what the model does at load and in its RoPE tables, checked in the unit tests, and Mixtral
only in its names and routing, which Qwen3-MoE's pipeline runs the same code for. The same
pipelines embed while they generate: Qwen3 by its last token (a plain checkpoint), the Mistral
directory as a sentence-transformers model that mean-pools, its prompts prefilled in chunks of 5."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from stageserve.tokenizer import load_tokenizer
from stageserve.v1 import common_pb2, prepare_pb2, prepare_pb2_grpc
from tests.integration.conftest import launch
from tests.integration.test_observability import metric, scrape
from tests.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.device.test_model_reference import hf_greedy

PROMPTS = ("Hello, world", "abcabcabc")  # 12 and 9 tokens: longer than the windows of 8
# Sent one after the other: the second finds the first's two full KV blocks (of 16 tokens) in the prefix cache.
PREFIX = "The first two KV blocks are cached."  # 35 tokens
EXTENDED = PREFIX + " The rest is prefilled."
MAX_TOKENS = 16
CHECKPOINTS = {
    "qwen3": {"family": "qwen3"},
    "mistral-window": {"family": "mistral", "sliding_window": 8},
    "gemma2": {"family": "gemma2", "sliding_window": 8},
    "gemma3": {"family": "gemma3", "sliding_window": 8},
    "qwen3_moe": {"family": "qwen3_moe"},
    "deepseek_v3": {"family": "deepseek_v3"},
}
MEAN_POOLED = {"mistral-window"}  # written as sentence-transformers directories that mean-pool
EMBEDDED = ("The quick brown fox", "x", "Hello, world")


def _as_mean_pooling_sentence_transformer(directory) -> None:
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (directory / "1_Pooling").mkdir()
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))


def _hf_embedding(hf, ids: list[int], mean: bool) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]  # [L, hidden], after the final norm
    return torch.nn.functional.normalize(hidden.mean(0) if mean else hidden[-1], dim=-1)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_tiny_checkpoint_through_the_services_gives_transformers_greedy_tokens(tmp_path_factory, name):
    """Two concurrent greedy requests (float32, continuous batching) on a tiny random checkpoint of
    each family give the tokens transformers' greedy ``generate`` gives for the same prompt ids; so
    does a prompt whose first 32 tokens come from the prefix cache (its prefill reads them back
    through the windowed and the global layers)."""
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp(name), **CHECKPOINTS[name])
    mean = name in MEAN_POOLED
    if mean:
        _as_mean_pooling_sentence_transformer(checkpoint)
    model = ["--model", str(checkpoint)]
    pipeline = launch(tmp_path_factory, f"{name}-pipeline", device_args=model, reclaim_args=model,
                      prepare_args=model + (["--max-prefill-chunk", "5"] if mean else []))
    try:
        with grpc.insecure_channel(pipeline.prepare.address) as channel:
            stub = prepare_pb2_grpc.GenerationStub(channel)
            requests = [prepare_pb2.GenerateRequest(prompt=p, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0) for p in PROMPTS]
            with ThreadPoolExecutor(len(requests) + 1) as pool:
                embedded = pool.submit(stub.Embed, prepare_pb2.EmbedRequest(input=EMBEDDED), timeout=120)
                served = [list(r.token_ids) for r in pool.map(lambda r: stub.Generate(r, timeout=120), requests)]
                embedding = embedded.result()
            for prompt in (PREFIX, EXTENDED):
                last = stub.Generate(prepare_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0), timeout=120)
                served.append(list(last.token_ids))
            info = stub.GetModelInfo(prepare_pb2.GetModelInfoRequest())
    finally:
        pipeline.stop()
    tokenizer = load_tokenizer(checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    expected = [hf_greedy(hf, list(tokenizer.encode(p, add_special_tokens=True)), MAX_TOKENS)[0] for p in (*PROMPTS, PREFIX, EXTENDED)]
    assert last.usage.cached_tokens == 32
    assert served == expected
    assert info.pooling == (common_pb2.POOLING_MEAN if mean else common_pb2.POOLING_LAST) and info.hidden_size == hf.config.hidden_size
    ids = [list(tokenizer.encode(text, add_special_tokens=True)) for text in EMBEDDED]
    assert embedding.prompt_tokens == sum(map(len, ids))
    for vector, prompt in zip(embedding.data, ids):
        torch.testing.assert_close(torch.tensor(list(vector.values)), _hf_embedding(hf, prompt, mean), atol=2e-5, rtol=1e-4)


WINDOW_BLOCK_SIZE = 4
LONG_GENERATION = 100  # with the 12-token prompt: 111 positions, 14x the window of 8


def test_a_windowed_sequence_far_past_its_window_holds_bounded_kv_and_gives_transformers_tokens(tmp_path_factory):
    """Mistral with a window of 8 on every layer, KV blocks of 4: a greedy stream of 100 tokens gives
    transformers' tokens while prepare's metrics show the sequence holding at most ceil(8 / 4) + 2
    blocks mid-stream (of the 28 its positions span) and the blocks left behind released."""
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("mistral-long"), **CHECKPOINTS["mistral-window"])
    model = ["--model", str(checkpoint)]
    pipeline = launch(tmp_path_factory, "mistral-long-pipeline", device_args=model + ["--block-size", str(WINDOW_BLOCK_SIZE)],
                      reclaim_args=model, prepare_args=model)
    held = []
    try:
        with grpc.insecure_channel(pipeline.prepare.address) as channel:
            stub = prepare_pb2_grpc.GenerationStub(channel)
            request = prepare_pb2.GenerateRequest(prompt=PROMPTS[0], max_tokens=LONG_GENERATION, ignore_eos=True, temperature=0.0)
            served = []
            for chunk in stub.GenerateStream(request, timeout=120):
                served += chunk.token_ids
                if 40 <= len(served) < LONG_GENERATION:
                    held.append(metric(scrape(pipeline.prepare), "stageserve_kv_cache_blocks_used"))
            released = metric(scrape(pipeline.prepare), "stageserve_kv_cache_window_released_blocks_total")
    finally:
        pipeline.stop()
    tokenizer = load_tokenizer(checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    prompt = list(tokenizer.encode(PROMPTS[0], add_special_tokens=True))
    assert served == hf_greedy(hf, prompt, LONG_GENERATION)[0]
    spanned = -(-(len(prompt) + LONG_GENERATION - 1) // WINDOW_BLOCK_SIZE)
    bound = -(-CHECKPOINTS["mistral-window"]["sliding_window"] // WINDOW_BLOCK_SIZE) + 2
    assert 0 < max(held) <= bound  # (0: the sequence had ended by then)
    assert released >= spanned - bound
