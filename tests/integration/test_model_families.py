"""The families added through ``services/device/model/README.md`` served through the three services:
Qwen3, Mistral with a sliding window shorter than the prompts, and Gemma 2 and Gemma 3 with such a
window on their local layers beside global ones (Gemma 2 soft-capped); one pipeline each. Phi-3 differs
only in what the model does at load and in its RoPE tables, checked in the unit tests."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from stageserve.tokenizer import load_tokenizer
from stageserve.v1 import prepare_pb2, prepare_pb2_grpc
from tests.integration.conftest import launch
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
}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_a_tiny_checkpoint_through_the_services_gives_transformers_greedy_tokens(tmp_path_factory, name):
    """Two concurrent greedy requests (float32, continuous batching) on a tiny random checkpoint of
    each family give the tokens transformers' greedy ``generate`` gives for the same prompt ids; so
    does a prompt whose first 32 tokens come from the prefix cache (its prefill reads them back
    through the windowed and the global layers)."""
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp(name), **CHECKPOINTS[name])
    model = ["--model", str(checkpoint)]
    pipeline = launch(tmp_path_factory, f"{name}-pipeline", device_args=model, prepare_args=model, reclaim_args=model)
    try:
        with grpc.insecure_channel(pipeline.prepare.address) as channel:
            stub = prepare_pb2_grpc.GenerationStub(channel)
            requests = [prepare_pb2.GenerateRequest(prompt=p, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0) for p in PROMPTS]
            with ThreadPoolExecutor(len(requests)) as pool:
                served = [list(r.token_ids) for r in pool.map(lambda r: stub.Generate(r, timeout=120), requests)]
            for prompt in (PREFIX, EXTENDED):
                last = stub.Generate(prepare_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0), timeout=120)
                served.append(list(last.token_ids))
    finally:
        pipeline.stop()
    tokenizer = load_tokenizer(checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    expected = [hf_greedy(hf, list(tokenizer.encode(p, add_special_tokens=True)), MAX_TOKENS)[0] for p in (*PROMPTS, PREFIX, EXTENDED)]
    assert last.usage.cached_tokens == 32
    assert served == expected
