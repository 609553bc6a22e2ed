"""Qwen3 (transformers ``Qwen3ForCausalLM``; llama.cpp ``src/models/qwen3.cpp``): Qwen2's layer
without q/k/v biases (unless ``attention_bias``), with an RMSNorm over ``head_dim`` on every query
and key head before RoPE (``q_norm``/``k_norm``; GGUF ``attn_q_norm``/``attn_k_norm``), and a
``head_dim`` given apart from hidden size / heads (GGUF ``qwen3.attention.key_length``)."""

from __future__ import annotations

from stageserve.device.model.family import Family, register

FAMILY = register(Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    hf_fields=lambda raw: {"attention_bias": bool(raw.get("attention_bias", False)), "qk_norm": True},
))
