"""Llama (transformers ``LlamaForCausalLM``; llama.cpp ``src/models/llama.cpp``): also SmolLM and
Mistral-style dense models without sliding window. The shared decoder is Llama's; the family adds
only its optional attention biases (q/k/v/o, ``attention_bias``) and llama.cpp's Q/K row order."""

from __future__ import annotations

from stageserve.device.model.family import Family, register

FAMILY = register(Family(
    name="llama",
    hf_model_types=("llama",),
    gguf_architectures=("llama",),
    hf_fields=lambda raw: {"attention_bias": bool(raw.get("attention_bias", False))},
    gguf_qk_permuted=True,
))
