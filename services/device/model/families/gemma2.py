"""Gemma 2 (transformers ``Gemma2ForCausalLM``, ``modeling_gemma2.py``; llama.cpp ``src/models/gemma2-iswa.cpp``):
Llama's layer with a GeGLU MLP (tanh-approximated GELU), ``(1 + w)`` RMSNorms (``hf_norm_offset``:
llama.cpp's ``convert_hf_to_gguf.py`` stores ``w + 1``), sandwich norms (``post_attention_layernorm``
on the attention output, ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the
MLP), embeddings scaled by ``sqrt(hidden_size)``, ``query_pre_attn_scalar ** -0.5`` as the softmax
scale, attention scores and final logits soft-capped (``attn_logit_softcapping``,
``final_logit_softcapping``), and local (``sliding_window``) and global layers interleaved by
``layer_types`` (Gemma2Config's default: even layers local); tied embeddings.

GGUF (``Gemma2Model``): architecture ``gemma2``, Q/K rows in Hugging Face order, the window and both
caps as ``gemma2.attention.sliding_window`` / ``gemma2.attn_logit_softcapping`` /
``gemma2.final_logit_softcapping``; no layer pattern or softmax scale is written: llama.cpp
(``llama-model.cpp``) takes every other layer as local and ``head_dim ** -0.5`` as the scale
(``(hidden / heads) ** -0.5`` for the 27B, 46 layers), which is what Google's checkpoints set."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stageserve.device.model.family import Family, register


def local_global_layers(num_layers: int, pattern: int) -> list[str]:
    """transformers' default ``layer_types`` of Gemma 2 (``pattern`` 2) and Gemma 3 (``sliding_window_pattern``):
    every ``pattern``-th layer global, the others local (llama.cpp's ``set_swa_pattern``)."""
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def gemma_hf_fields(raw: Mapping[str, Any], pattern: int) -> dict[str, Any]:
    """The fields Gemma 2 and Gemma 3 read alike from ``config.json`` (defaults: transformers' ``Gemma2Config``);
    ``pattern``: the local/global interleave where ``layer_types`` is absent."""
    return {
        "hidden_act": raw.get("hidden_activation") or "gelu_pytorch_tanh",
        "attention_bias": bool(raw.get("attention_bias", False)),
        "sandwich_norms": True,
        "embed_scale": int(raw["hidden_size"]) ** 0.5,
        "attention_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        "sliding_window": raw.get("sliding_window", 4096),
        "layer_types": raw.get("layer_types") or local_global_layers(int(raw["num_hidden_layers"]), pattern),
    }


def gemma_gguf_fields(common: Mapping[str, Any], layers_of_27b: int) -> dict[str, Any]:
    """What llama.cpp derives from a Gemma GGUF's architecture rather than reads: the activation, the
    embedding scale and the softmax scale (``(hidden / heads) ** -0.5`` for the 27B model, which
    llama.cpp tells by its ``layers_of_27b`` layers; ``head_dim ** -0.5`` otherwise)."""
    big = common["num_layers"] == layers_of_27b
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "embed_scale": common["hidden_size"] ** 0.5,
        "attention_scale": (common["hidden_size"] // common["num_heads"] if big else common["head_dim"]) ** -0.5,
    }


def _gguf_fields(fields: Mapping[str, Any], arch: str, common: Mapping[str, Any]) -> dict[str, Any]:
    layers = common["num_layers"]
    return gemma_gguf_fields(common, layers_of_27b=46) | {
        "attn_softcap": float(fields.get(f"{arch}.attn_logit_softcapping", 50.0)) or None,  # llama.cpp's defaults
        "final_softcap": float(fields.get(f"{arch}.final_logit_softcapping", 30.0)) or None,
        "sliding_window": int(fields.get(f"{arch}.attention.sliding_window", 4096)) or None,
        "full_attention_layers": tuple(range(1, layers, 2)),
    }


FAMILY = register(Family(
    name="gemma2",
    hf_model_types=("gemma2",),
    gguf_architectures=("gemma2",),
    hf_fields=lambda raw: gemma_hf_fields(raw, pattern=2) | {
        "attn_softcap": raw.get("attn_logit_softcapping", 50.0), "final_softcap": raw.get("final_logit_softcapping", 30.0),
    },
    hf_norm_offset=1.0,
    gguf_fields=_gguf_fields,
))
