"""Phi-3 / Phi-4-mini (transformers ``Phi3ForCausalLM``, ``modeling_phi3.py``): Llama's layer with
fused ``qkv_proj`` and ``gate_up_proj`` (split at load, ``weights.py``), RoPE on the first
``partial_rotary_factor`` of each head (``ModelConfig.rotary_dim``), ``longrope`` scaling (short and
long factors, ``rope.py``) and an optional ``sliding_window`` over every layer. llama.cpp's GGUF
(``Phi3MiniModel`` in ``convert_hf_to_gguf.py``, ``src/models/phi3.cpp``): fused ``attn_qkv`` and
``ffn_up`` (gate rows first), ``rope.dimension_count`` the rotating values only, the factors as
``rope_factors_long``/``rope_factors_short`` tensors, Q/K rows in Hugging Face order (NeoX RoPE),
``sliding_window`` 0 for none."""

from __future__ import annotations

from stageserve.device.model.family import Family, register

FAMILY = register(Family(
    name="phi3",
    hf_model_types=("phi3",),
    gguf_architectures=("phi3",),
    hf_fields=lambda raw: {"sliding_window": raw.get("sliding_window")},
    gguf_partial_rotary=True,
))
