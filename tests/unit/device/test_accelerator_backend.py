"""The cuda/npu backend (`StreamBackend`: compute stream, pinned slot buffers, event completions)
against the cpu backend, on the same randomly initialised checkpoint in float32.

Skipped where torch sees no CUDA or Ascend NPU device, as on CI; on an accelerator machine run
``pytest tests/unit/device/test_accelerator_backend.py tests/integration/test_accelerator_pipeline.py``.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from stageserve.device.backends import StreamBackend
from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.forward_batch import build_forward_batch
from stageserve.device.model.decoder import DecoderModel
from tests.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.device.test_executor import run_plans


def available_accelerator() -> str | None:
    """``cuda`` or ``npu`` when torch sees such a device, else ``None``."""
    if torch.cuda.is_available():
        return "cuda"
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return None
    return "npu" if torch.npu.is_available() else None


ACCELERATOR = available_accelerator()
pytestmark = pytest.mark.skipif(ACCELERATOR is None, reason="no CUDA or Ascend NPU device")
PROMPTS = ([72, 101, 108, 108, 111, 44, 32], [87, 111, 114, 108, 100])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def greedy_logits(model: DecoderModel, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Prefill ``prompt`` then ``new_tokens`` greedy decode steps; (tokens, logits [1 + new_tokens, vocab] on the CPU)."""
    kv = PagedKVCache(model.config, 8, 16, model.dtype, model.device)
    ids, tokens, logits = list(prompt), [], []
    with torch.inference_mode():
        step = model.forward(build_forward_batch([(ids, 0, list(range(8)), True)], 16, model.device), kv)
        for _ in range(new_tokens + 1):
            logits.append(step[0].float().cpu())
            tokens.append(int(step[0].argmax()))
            step = model.forward(build_forward_batch([([tokens[-1]], len(ids) + len(tokens) - 1, list(range(8)), True)], 16, model.device), kv)
    return tokens, torch.stack(logits)


def test_forward_matches_the_cpu(checkpoint):
    """Prefill + 16 decode steps: float32 logits within 1e-4 of the CPU's and the same greedy tokens."""
    cpu = DecoderModel.from_path(checkpoint, torch.float32, "cpu")
    accelerated = DecoderModel.from_path(checkpoint, torch.float32, ACCELERATOR)
    (tokens, logits), (ref_tokens, ref_logits) = greedy_logits(accelerated, list(PROMPTS[0]), 16), greedy_logits(cpu, list(PROMPTS[0]), 16)
    assert (logits - ref_logits).abs().max() < 1e-4
    assert tokens == ref_tokens


def test_bfloat16_forward_stays_close_to_float32(checkpoint):
    """bfloat16 weights and KV cache on the accelerator: prefill logits within 0.25 of float32 (the CPU measures 0.06)."""
    fp32 = DecoderModel.from_path(checkpoint, torch.float32, ACCELERATOR)
    bf16 = DecoderModel.from_path(checkpoint, torch.bfloat16, ACCELERATOR)
    (_, ref), (_, low) = greedy_logits(fp32, list(PROMPTS[0]), 0), greedy_logits(bf16, list(PROMPTS[0]), 0)
    assert (low - ref).abs().max() < 0.25


@pytest.mark.parametrize("dispatch", ["async", "sync"])
def test_executor_steps_match_the_cpu_backend(checkpoint, dispatch):
    """Prefill + 5 decode steps with placeholders, a greedy and a seeded top-p row with a repetition
    penalty, through the executor: the stream backend samples exactly the cpu backend's ids."""
    cpu = DecoderModel.from_path(checkpoint, torch.float32, "cpu")
    accelerated = DecoderModel.from_path(checkpoint, torch.float32, ACCELERATOR)
    reference = run_plans(cpu, "async", prompts=PROMPTS)
    assert run_plans(accelerated, dispatch, backend=StreamBackend(ACCELERATOR), prompts=PROMPTS) == reference
    assert len(reference) == 6 and all(len(ids) == 2 for ids in reference)


def test_slot_buffers_are_pinned():
    """Slot-local host buffers are page-locked, so the device-to-host copy of sampled ids is asynchronous."""
    backend = StreamBackend(ACCELERATOR)
    assert backend.host_buffer((4,), torch.int64).is_pinned()
