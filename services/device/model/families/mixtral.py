"""Mixtral (transformers ``MixtralForCausalLM``, ``modeling_mixtral.py``; Jiang et al. 2024, "Mixtral of
Experts"): Mistral's layer with a mixture of ``num_local_experts`` SwiGLU experts of
``intermediate_size`` in every layer (``moe.py``), each token's ``num_experts_per_tok`` weighted by the
softmax over the selected experts' router logits (equal to the full softmax's top-k renormalised,
``norm_topk_prob``). Checkpoints name the block ``block_sparse_moe`` and the experts' projections
``w1`` (gate), ``w3`` (up), ``w2`` (down), renamed at load into Qwen3-MoE's names.

llama.cpp's ``convert_hf_to_gguf.py`` writes Mixtral as architecture ``llama`` (``LlamaModel``: Q/K rows
permuted) with ``llama.expert_count`` / ``llama.expert_used_count`` and 3-D ``ffn_*_exps`` tensors, so
a Mixtral GGUF loads through the llama family with experts (``config_from_gguf``)."""

from __future__ import annotations

import re

from stageserve.device.model.family import Family, register

_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _renamed(name: str) -> str:
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return re.sub(r"(\.experts\.\d+\.)(w[123])\.", lambda m: f"{m[1]}{_PROJECTIONS[m[2]]}.", name)


FAMILY = register(Family(
    name="mixtral",
    hf_model_types=("mixtral",),
    gguf_architectures=(),
    hf_fields=lambda raw: {  # defaults: transformers' MixtralConfig
        "sliding_window": raw.get("sliding_window"), "num_experts": int(raw.get("num_local_experts", 8)),
        "experts_per_token": int(raw.get("num_experts_per_tok", 2)), "moe_intermediate_size": int(raw["intermediate_size"]),
        "norm_topk_prob": True,
    },
    hf_weight_names=_renamed,
))
