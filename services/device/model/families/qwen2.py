"""Qwen2 (transformers ``Qwen2ForCausalLM``; llama.cpp ``src/models/qwen2.cpp``): Llama's layer with
q/k/v biases always (no o_proj bias); llama.cpp keeps its Q/K rows in Hugging Face order (NeoX RoPE)."""

from __future__ import annotations

from stageserve.device.model.family import Family, register

FAMILY = register(Family(
    name="qwen2",
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    hf_fields=lambda raw: {"attention_bias": True},
))
