"""Qwen3-MoE (transformers ``Qwen3MoeForCausalLM``, ``modeling_qwen3_moe.py``; llama.cpp
``src/models/qwen3moe.cpp``): Qwen3's layer (q/k norms, ``head_dim`` of its own) with a mixture of
experts as the MLP (``moe.py``): softmax router, top ``num_experts_per_tok``, renormalised with
``norm_topk_prob``; a layer keeps the dense MLP of ``intermediate_size`` where it is in
``mlp_only_layers`` or ``decoder_sparse_step`` skips it (``Qwen3MoeDecoderLayer``).

GGUF (``Qwen3MoeModel`` in ``convert_hf_to_gguf.py``): architecture ``qwen3moe``, the experts as 3-D
``ffn_{gate,up,down}_exps``, the router as ``ffn_gate_inp``, ``qwen3moe.expert_feed_forward_length``;
llama.cpp always renormalises the top-k weights (as ``norm_topk_prob: true``, Qwen's checkpoints)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from stageserve.device.model.family import Family, register


def _hf_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    # defaults: transformers' Qwen3MoeConfig, which saves num_experts as num_local_experts (its attribute_map)
    layers, step, dense = int(raw["num_hidden_layers"]), int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers") or ())
    return {
        "attention_bias": bool(raw.get("attention_bias", False)), "qk_norm": True,
        "num_experts": int(raw.get("num_experts") or raw.get("num_local_experts", 128)), "experts_per_token": int(raw.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": int(raw.get("moe_intermediate_size", 768)), "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "dense_mlp_layers": tuple(i for i in range(layers) if i in dense or (i + 1) % step),
    }


FAMILY = register(Family(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    hf_fields=_hf_fields,
))
