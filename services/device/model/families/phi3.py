"""Phi-3 / Phi-4-mini (transformers ``Phi3ForCausalLM``, ``modeling_phi3.py``): Llama's layer with
fused ``qkv_proj`` and ``gate_up_proj`` (split at load, ``weights.py``), RoPE on the first
``partial_rotary_factor`` of each head (``ModelConfig.rotary_dim``), ``longrope`` scaling (short and
long factors, ``rope.py``) and an optional ``sliding_window`` over every layer. From a Hugging Face
directory only: its GGUF form (llama.cpp's ``phi3``: fused ``attn_qkv``, ``rope_factors_long/short``)
is not read yet."""

from __future__ import annotations

from stageserve.device.model.family import Family, register

FAMILY = register(Family(
    name="phi3",
    hf_model_types=("phi3",),
    gguf_architectures=(),
    hf_fields=lambda raw: {"sliding_window": raw.get("sliding_window")},
))
