"""A family added through ``services/device/model/README.md`` (Qwen3) served through the three services."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from transformers import AutoModelForCausalLM

from stageserve.tokenizer import load_tokenizer
from stageserve.v1 import prepare_pb2, prepare_pb2_grpc
from tests.integration.conftest import launch
from tests.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.device.test_model_reference import hf_greedy

PROMPTS = ("Hello, world", "abcabcabc")
MAX_TOKENS = 16


def test_a_tiny_qwen3_through_the_services_gives_transformers_greedy_tokens(tmp_path_factory):
    """Two concurrent greedy requests (float32, continuous batching) on a tiny random Qwen3 checkpoint
    give the tokens transformers' greedy ``generate`` gives for the same prompt ids."""
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3")
    model = ["--model", str(checkpoint)]
    pipeline = launch(tmp_path_factory, "qwen3-pipeline", device_args=model, prepare_args=model, reclaim_args=model)
    try:
        with grpc.insecure_channel(pipeline.prepare.address) as channel:
            stub = prepare_pb2_grpc.GenerationStub(channel)
            requests = [prepare_pb2.GenerateRequest(prompt=p, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0) for p in PROMPTS]
            with ThreadPoolExecutor(len(requests)) as pool:
                served = [list(r.token_ids) for r in pool.map(lambda r: stub.Generate(r, timeout=120), requests)]
    finally:
        pipeline.stop()
    tokenizer = load_tokenizer(checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    expected = [hf_greedy(hf, list(tokenizer.encode(p, add_special_tokens=True)), MAX_TOKENS)[0] for p in PROMPTS]
    assert served == expected
