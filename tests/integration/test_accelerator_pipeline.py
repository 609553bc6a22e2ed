"""The three services with the device on a cuda/npu backend, against the same services on the CPU.

Skipped where torch sees no CUDA or Ascend NPU device, as on CI. The model is a tiny randomly
initialised checkpoint with a byte-level tokenizer (`tests.tiny_checkpoint`), written offline, so
the test needs no model file on the accelerator machine.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from stageserve.v1 import prepare_pb2, prepare_pb2_grpc
from tests.integration.conftest import launch
from tests.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.device.test_accelerator_backend import ACCELERATOR

pytestmark = pytest.mark.skipif(ACCELERATOR is None, reason="no CUDA or Ascend NPU device")
PROMPTS = ["Hello, world", "The quick brown fox", "Paged attention keeps a block table", "1 2 3"]


def greedy_ids(tmp_path_factory, checkpoint, backend: str, dispatch: str) -> tuple[list[list[int]], prepare_pb2.ModelInfo]:
    """Token ids of 24 greedy tokens (ignore_eos) for each of `PROMPTS`, sent concurrently, plus GetModelInfo."""
    model = ["--model", str(checkpoint)]
    pipeline = launch(tmp_path_factory, f"{backend}-{dispatch}", device_args=[*model, "--backend", backend, "--dispatch", dispatch],
                      prepare_args=model, reclaim_args=model)
    try:
        with grpc.insecure_channel(pipeline.prepare.address) as channel:
            stub = prepare_pb2_grpc.GenerationStub(channel)
            requests = [prepare_pb2.GenerateRequest(prompt=p, max_tokens=24, ignore_eos=True, temperature=0.0) for p in PROMPTS]
            with ThreadPoolExecutor(len(requests)) as pool:
                responses = list(pool.map(lambda r: stub.Generate(r, timeout=120), requests))
            info = stub.GetModelInfo(prepare_pb2.GetModelInfoRequest(), timeout=30)
        return [list(r.token_ids) for r in responses], info
    finally:
        pipeline.stop()


def test_accelerator_pipeline_generates_the_cpu_tokens(tmp_path_factory):
    """Four concurrent greedy requests (continuous batching, placeholders, pinned slot buffers, event
    completions) give the CPU pipeline's tokens in float32, with async and with sync dispatch."""
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    reference, _ = greedy_ids(tmp_path_factory, checkpoint, "cpu", "async")
    assert all(len(ids) == 24 for ids in reference)
    for dispatch in ("async", "sync"):
        ids, info = greedy_ids(tmp_path_factory, checkpoint, ACCELERATOR, dispatch)
        assert (info.backend, info.dispatch, info.dtype) == (ACCELERATOR, dispatch, "float32")
        assert ids == reference
