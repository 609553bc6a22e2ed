"""Gemma 3 text (transformers ``Gemma3ForCausalLM``, ``modular_gemma3.py``; llama.cpp ``src/models/gemma3.cpp``):
Gemma 2's layer (``families/gemma2.py``) with ``(1 + w)`` RMSNorms also over each query and key head
before RoPE (``q_norm``/``k_norm``), no attention soft-capping (transformers' ``Gemma3Attention``
ignores ``attn_logit_softcapping``), final logits capped only where ``final_logit_softcapping`` is
set, five local layers to one global (``layer_types``, or ``sliding_window_pattern`` in older
configs), and the local layers' own RoPE base (``rope_local_base_freq``, or
``rope_parameters.sliding_attention``) without the global layers' ``rope_scaling``.

A multimodal ``gemma3`` config (``Gemma3ForConditionalGeneration``) serves its language model: its
``text_config`` (with transformers' ``Gemma3TextConfig`` defaults for the keys Google's configs omit)
and the ``language_model`` tensors; the vision tower is not loaded, so images are not supported.

GGUF (``Gemma3Model``): architecture ``gemma3``, ``attn_q_norm``/``attn_k_norm``, the global RoPE
base as ``rope.freq_base``; llama.cpp (``llama-model.cpp``) fixes the pattern (every sixth layer
global), the local base (10000) and the softmax scale, and windows no layer without
``gemma3.attention.sliding_window``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stageserve.device.model.families.gemma2 import gemma_gguf_fields, gemma_hf_fields
from stageserve.device.model.family import Family, Unsupported, register

# transformers' Gemma3TextConfig defaults (the 4B's shape) for keys a multimodal config's text_config omits.
_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
}
_GLOBAL_THETA, _LOCAL_THETA, _PATTERN = 1_000_000.0, 10_000.0, 6


def _hf_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """``config.json`` as the common reader takes it: a multimodal config's ``text_config`` (with the
    outer token ids), the defaults filled in, ``rope_parameters`` the global layers' and
    ``rope_local_base_freq`` the local layers' base."""
    if raw.get("model_type") == "gemma3":
        text = dict(raw.get("text_config") or {})
        if text.get("model_type", "gemma3_text") != "gemma3_text":
            raise Unsupported(f"unsupported text_config.model_type {text['model_type']!r} (supported: gemma3_text)")
        for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings"):
            if key in raw:
                text.setdefault(key, raw[key])
        raw = text
    raw = _TEXT_DEFAULTS | dict(raw)
    rope = raw.get("rope_parameters") or {}
    if "full_attention" in rope:  # transformers 5: one rope_parameters per layer type
        global_rope, local_rope = dict(rope["full_attention"] or {}), dict(rope.get("sliding_attention") or {})
    else:  # older configs: rope_theta and rope_scaling for the global layers, rope_local_base_freq
        global_rope, local_rope = dict(rope or raw.get("rope_scaling") or {}), {"rope_theta": raw.get("rope_local_base_freq", _LOCAL_THETA)}
    if local_rope.get("rope_type", "default") != "default":
        raise Unsupported(f"unsupported rope_parameters.sliding_attention rope_type {local_rope['rope_type']!r} (supported: default)")
    global_rope.setdefault("rope_theta", raw.get("rope_theta", _GLOBAL_THETA))
    return raw | {"rope_parameters": global_rope, "rope_local_base_freq": float(local_rope.get("rope_theta", _LOCAL_THETA))}


def _hf_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or _PATTERN
    return gemma_hf_fields(raw, int(pattern)) | {
        "qk_norm": True, "local_rope_theta": raw["rope_local_base_freq"], "final_softcap": raw.get("final_logit_softcapping"),
    }


def _gguf_fields(fields: Mapping[str, Any], arch: str, common: Mapping[str, Any]) -> dict[str, Any]:
    layers, window = common["num_layers"], int(fields.get(f"{arch}.attention.sliding_window") or 0) or None
    windowed = {"full_attention_layers": tuple(range(_PATTERN - 1, layers, _PATTERN)), "local_rope_theta": _LOCAL_THETA} if window else {}
    return gemma_gguf_fields(common, layers_of_27b=62) | windowed | {
        "sliding_window": window, "final_softcap": float(fields.get(f"{arch}.final_logit_softcapping") or 0) or None,
    }


FAMILY = register(Family(
    name="gemma3",
    hf_model_types=("gemma3_text", "gemma3"),
    gguf_architectures=("gemma3",),
    hf_fields=_hf_fields,
    hf_config=_hf_config,
    hf_norm_offset=1.0,
    # Gemma3ForConditionalGeneration's language model, as transformers 5 saves it and as Google's checkpoints have it
    hf_weight_prefixes=(("model.language_model.", "model."), ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
    gguf_fields=_gguf_fields,
))
