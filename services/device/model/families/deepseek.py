"""DeepSeek-V2 and DeepSeek-V3 (transformers ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``,
``modeling_deepseek_v2.py`` / ``modeling_deepseek_v3.py``; llama.cpp ``src/models/deepseek2.cpp``):
multi-head latent attention (``mla.py``: ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
``qk_rope_head_dim``, ``v_head_dim``; the rotated values paired as DeepSeek writes them), the softmax
scale ``(qk_nope + qk_rope) ** -0.5`` times YaRN's ``mscale(factor, mscale_all_dim) ** 2``
(transformers' ``yarn_apply_mscale``), and a mixture of experts (``moe.py``) in every layer from
``first_k_dense_replace`` on, with ``n_shared_experts`` shared experts and DeepSeek's routers: V2's
softmax (``topk_method`` ``greedy``, or ``group_limited_greedy`` over ``n_group`` groups keeping
``topk_group``), V3's sigmoid with ``e_score_correction_bias`` over groups (``noaux_tc``);
``routed_scaling_factor``, ``norm_topk_prob`` (for V2 too, as DeepSeek's own ``modeling_deepseek.py``
renormalises; transformers' V2 router ignores the flag, which DeepSeek's V2 checkpoints leave false).
The checkpoint's multi-token-prediction layers (``num_nextn_predict_layers``,
``model.layers.{num_hidden_layers}.*``) are not part of the model: ``--speculative-method mtp``
loads the first as its proposer (``weights.load_mtp_weights``, ``speculation/mtp.py``).

GGUF (``DeepseekV2Model`` in ``convert_hf_to_gguf.py``): architecture ``deepseek2`` for both; one KV
head, ``key_length`` / ``value_length`` the latent's (``kv_lora_rank + qk_rope``, ``kv_lora_rank``),
``key_length_mla`` / ``value_length_mla`` a head's, ``rope.dimension_count`` the rotated values,
``kv_b_proj`` split into ``attn_k_b`` / ``attn_v_b`` (joined at load, ``weights._joined_kv_b``), the
shared experts as ``ffn_*_shexp``, the correction bias as ``exp_probs_b``; the routing from
``expert_gating_func`` (2: sigmoid), ``expert_group_count`` / ``expert_group_used_count``,
``expert_weights_scale`` / ``expert_weights_norm``; YaRN's ``mscale_all_dim`` as
``rope.scaling.yarn_log_multiplier`` (0.1 x). Q/K rows are not permuted (llama.cpp's NORM RoPE pairs
them as DeepSeek does)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from stageserve.device.model.family import Family, Unsupported, register

# (scoring_func, topk_method) -> router_scoring, whether experts are grouped: transformers' routers
_ROUTERS = {("softmax", "greedy"): ("softmax", False), ("softmax", "group_limited_greedy"): ("softmax", True),
            ("sigmoid", "noaux_tc"): ("sigmoid", True)}
_GGUF_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def _mscale(factor: float, m: float) -> float:
    """YaRN's attention scaling (transformers' ``yarn_get_mscale``)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _softmax_scale(qk_head_dim: int, rope: Mapping[str, Any] | None) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN scaling (``yarn_apply_mscale``)."""
    scale = qk_head_dim**-0.5
    if rope and rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        scale *= _mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return scale


def _hf_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The rotated values as the heads' ``head_dim`` (what the RoPE tables span, as transformers sets it)
    and one KV "head": the shared latent."""
    return dict(raw) | {"head_dim": int(raw["qk_rope_head_dim"]), "num_key_value_heads": 1}


def _hf_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    v3 = raw["model_type"] == "deepseek_v3"  # defaults: transformers' DeepseekV3Config / DeepseekV2Config
    if raw.get("attention_bias"):
        raise Unsupported(f"unsupported attention_bias {raw['attention_bias']!r} (supported: false)")
    if int(raw.get("moe_layer_freq", 1)) != 1:
        raise Unsupported(f"unsupported moe_layer_freq {raw['moe_layer_freq']!r} (supported: 1)")
    # transformers' V3 router is always sigmoid + noaux_tc; its V2 router softmax + greedy or group_limited_greedy
    key = (raw.get("scoring_func", "sigmoid" if v3 else "softmax"), raw.get("topk_method", "noaux_tc" if v3 else "greedy"))
    if key not in _ROUTERS:
        raise Unsupported(f"unsupported scoring_func / topk_method {key[0]!r} / {key[1]!r} "
                          f"(supported: {', '.join(f'{s} / {m}' for s, m in _ROUTERS)})")
    scoring, grouped = _ROUTERS[key]
    nope, rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    experts = int(raw.get("n_routed_experts") or 0)
    layers = int(raw["num_hidden_layers"])
    return {
        "kv_lora_rank": int(raw["kv_lora_rank"]), "q_lora_rank": raw.get("q_lora_rank", 1536),
        "qk_nope_head_dim": nope, "v_head_dim": int(raw["v_head_dim"]), "rope_interleaved": bool(raw.get("rope_interleave", True)),
        "attention_scale": _softmax_scale(nope + rope, raw.get("rope_parameters") or raw.get("rope_scaling")),
        "num_experts": experts, "experts_per_token": int(raw.get("num_experts_per_tok") or 0),
        "moe_intermediate_size": int(raw.get("moe_intermediate_size", 2048 if v3 else 1407)),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", v3)), "router_scoring": scoring,
        "expert_groups": int(raw.get("n_group") or 1) if grouped else 1, "expert_groups_kept": int(raw.get("topk_group") or 1) if grouped else 1,
        "routed_scaling_factor": float(raw.get("routed_scaling_factor", 2.5 if v3 else 1.0)),
        "shared_experts": int(raw.get("n_shared_experts") or 0) if experts else 0,
        "dense_mlp_layers": tuple(range(min(int(raw.get("first_k_dense_replace", 3 if v3 else 0)), layers))),
    }


def _gguf_fields(fields: Mapping[str, Any], arch: str, common: Mapping[str, Any]) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    rope = int(get("rope.dimension_count"))
    key_length, value_length = get("attention.key_length_mla") or get("attention.key_length"), get("attention.value_length_mla") or get("attention.value_length")
    scaling = dict(common["rope_scaling"] or {})
    if scaling.get("rope_type") == "yarn" and get("rope.scaling.yarn_log_multiplier"):  # 0.1 * mscale_all_dim (DeepSeek's mscale the same)
        scaling["mscale"] = scaling["mscale_all_dim"] = float(get("rope.scaling.yarn_log_multiplier")) / 0.1
    q_lora = get("attention.q_lora_rank")
    return {
        "head_dim": rope, "num_kv_heads": 1, "kv_lora_rank": int(get("attention.kv_lora_rank")), "q_lora_rank": int(q_lora) if q_lora else None,
        "qk_nope_head_dim": int(key_length) - rope, "v_head_dim": int(value_length), "rope_interleaved": True,
        "rope_scaling": scaling or None, "attention_scale": _softmax_scale(int(key_length), scaling),
        "norm_topk_prob": bool(get("expert_weights_norm", False)), "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "shared_experts": int(get("expert_shared_count", 0)),
        "router_scoring": "sigmoid" if int(get("expert_gating_func", 1)) == _GGUF_SIGMOID else "softmax",
        "expert_groups": int(get("expert_group_count") or 1), "expert_groups_kept": int(get("expert_group_used_count") or 1),
    }


FAMILY = register(Family(
    name="deepseek",
    hf_model_types=("deepseek_v2", "deepseek_v3"),
    gguf_architectures=("deepseek2",),
    hf_fields=_hf_fields,
    hf_config=_hf_config,
    gguf_fields=_gguf_fields,
))
