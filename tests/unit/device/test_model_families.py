"""Model families: the registry, and each family added through ``services/device/model/README.md``'s
steps (Qwen3, Mistral with and without a sliding window, Phi-3, Gemma 2, Gemma 3, Qwen3-MoE, Mixtral,
DeepSeek-V3 and DeepSeek-V2 with latent attention) computing what
transformers computes, from a Hugging Face directory, on the fused CPU kernels and on plain torch ops,
and from the same weights as GGUF."""

from __future__ import annotations

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, yarn_apply_mscale

from stageserve.device.assembly import kv_window
from stageserve.device.kernels import cpu_kernels as cpu_kernel_ops
from stageserve.device.model import family
from stageserve.device.model.decoder import DecoderModel
from stageserve.device.model.forward_batch import build_forward_batch
from stageserve.device.model.kv_cache import PagedKVCache, bytes_per_block
from stageserve.device.model.rope import interleaved_row_order, rope_tables
from stageserve.device.kernels.quant import QuantizedWeight
from stageserve.device.model.weights import ModelLoadError, load_config, load_weights
from tests.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.device.test_model_reference import BLOCK_SIZE, greedy, hf_greedy

NEW_TOKENS = 24  # a prefill and 23 decode steps; logits are compared over the prefill and 16 decode steps
PROMPT_LENGTH = 40  # 5 windows of Mistral's and Gemma's 8 tokens
WINDOW = 8

# id -> write_tiny_checkpoint arguments
CHECKPOINTS = {
    "qwen3": {"family": "qwen3"},
    "mistral": {"family": "mistral"},
    "mistral-window": {"family": "mistral", "sliding_window": WINDOW},
    "phi3": {"family": "phi3"},
    "gemma2": {"family": "gemma2", "sliding_window": WINDOW},  # local and global layers alternating, soft-capped
    # a softmax scale that is not head_dim ** -0.5 (llama.cpp's GGUF cannot say it: no GGUF of this one)
    "gemma2-scalar": {"family": "gemma2", "sliding_window": WINDOW, "overrides": {"query_pre_attn_scalar": 24}},
    "gemma3": {"family": "gemma3", "sliding_window": WINDOW},  # five local layers, one global with scaled RoPE
    "qwen3_moe": {"family": "qwen3_moe"},  # 8 experts, top 2, layer 0 dense (mlp_only_layers)
    "mixtral": {"family": "mixtral"},  # 8 experts, top 2, in both layers
    # latent attention; layer 0 dense, then 8 experts in 4 groups (2 kept), top 2, shared experts
    "deepseek_v3": {"family": "deepseek_v3"},  # q_lora_rank, YaRN with mscale_all_dim, sigmoid routing with a correction bias
    "deepseek_v2": {"family": "deepseek_v2"},  # q_proj, softmax group_limited_greedy routing
}
GGUF_ARCHITECTURES = {"qwen3": "qwen3", "mistral": "llama", "mistral-window": "llama", "phi3": "phi3",
                      "gemma2": "gemma2", "gemma3": "gemma3", "qwen3_moe": "qwen3moe", "mixtral": "llama",
                      "deepseek_v3": "deepseek2", "deepseek_v2": "deepseek2"}  # as llama.cpp writes them
DEEPSEEK = ("deepseek_v3", "deepseek_v2")


def test_every_family_is_registered_under_its_hf_and_gguf_names():
    assert [f.name for f in family.families()] == ["deepseek", "gemma2", "gemma3", "llama", "mistral", "mixtral", "phi3", "qwen2", "qwen3",
                                                   "qwen3_moe"]
    assert family.hf_model_types() == ("deepseek_v2", "deepseek_v3", "gemma2", "gemma3", "gemma3_text", "llama", "mistral", "mixtral", "phi3",
                                       "qwen2", "qwen3", "qwen3_moe")
    # llama.cpp writes Mistral and Mixtral as llama
    assert family.gguf_architectures() == ("deepseek2", "gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen3", "qwen3moe")
    assert family.family_for_hf("deepseek_v2").name == family.family_for_gguf("deepseek2").name == "deepseek"
    assert family.family_for_hf("gemma3").name == family.family_for_hf("gemma3_text").name == "gemma3"
    assert family.family_for_hf("qwen3").name == "qwen3" and family.family_for_gguf("qwen3").name == "qwen3"
    assert family.family_for_hf("mistral").name == "mistral" and family.family_for_hf("phi3").name == "phi3"
    assert family.family_for_gguf("phi3").name == "phi3" and family.family_for_gguf("mistral") is None
    assert family.family_for_hf("gpt2") is None and family.family_for_gguf("gpt2") is None
    assert family.family_named("llama").gguf_qk_permuted and not family.family_named("qwen3").gguf_qk_permuted


def test_a_name_claimed_twice_is_refused():
    with pytest.raises(ValueError, match=r"qwen3 already registered by 'qwen3'"):
        family.register(family.Family("qwen3-copy", ("qwen3",), (), lambda raw: {}))


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    """A tiny random checkpoint of each family written by transformers (see ``write_tiny_checkpoint``)."""
    return request.param, write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), **CHECKPOINTS[request.param])


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' greedy tokens and per-step float32 logits for a fixed prompt longer than Mistral's window."""
    torch.manual_seed(0)
    prompt = torch.randint(3, 257, (PROMPT_LENGTH,)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint[1]), dtype=torch.float32).eval()
    return prompt, *hf_greedy(hf, prompt, NEW_TOKENS)


def test_configs_read_each_familys_fields(checkpoint):
    name, path = checkpoint
    config = load_config(path)
    expected = {
        "qwen3": ("qwen3", 64, True, None, None),
        "mistral": ("mistral", 64, False, None, None),
        "mistral-window": ("mistral", 64, False, WINDOW, None),
        "phi3": ("phi3", 64, False, None, 32),
        "gemma2": ("gemma2", 64, False, WINDOW, None),
        "gemma2-scalar": ("gemma2", 64, False, WINDOW, None),
        "gemma3": ("gemma3", 64, True, WINDOW, None),
        "qwen3_moe": ("qwen3_moe", 64, True, None, None),
        "mixtral": ("mixtral", 64, False, None, None),
        "deepseek_v3": ("deepseek", 16, False, None, None),  # head_dim: the rotated values (transformers' too)
        "deepseek_v2": ("deepseek", 16, False, None, None),
    }[name]
    assert (config.architecture, config.head_dim, config.qk_norm, config.sliding_window, config.rotary_dim) == expected
    assert not config.attention_bias
    if name == "phi3":
        assert config.rope_scaling["rope_type"] == "longrope" and config.rope_scaling["original_max_position_embeddings"] == 128
    gemma = name.startswith("gemma")
    assert (config.hidden_act, config.sandwich_norms, config.embed_scale) == (("gelu_pytorch_tanh", True, 8.0) if gemma else ("silu", False, None))
    hf = AutoConfig.from_pretrained(str(path))
    # DeepSeek: transformers' DeepseekV3Attention.scaling, with YaRN's mscale_all_dim
    mla_scale = yarn_apply_mscale(hf.rope_parameters, 32**-0.5) if name in DEEPSEEK else None
    assert config.softmax_scale == pytest.approx({"gemma2-scalar": 24**-0.5, "deepseek_v3": mla_scale, "deepseek_v2": mla_scale}.get(name, 64**-0.5))
    assert name != "deepseek_v3" or config.softmax_scale > 32**-0.5  # the YaRN mscale counts
    assert (config.attn_softcap, config.final_softcap) == ((5.0, 10.0) if name.startswith("gemma2") else (None, None))
    assert config.layer_windows == {"gemma3": (WINDOW,) * 5 + (None,)}.get(name, (WINDOW, None) if gemma else (config.sliding_window,) * 2)
    # the window prepare releases KV blocks by (AttachReply.kv_window): only where every layer has it, in the draft model too
    assert (kv_window(config), kv_window(config, config)) == ((WINDOW, WINDOW) if name == "mistral-window" else (0, 0))
    moe = {"qwen3_moe": (8, 2, 64, True, (False, True)), "mixtral": (8, 2, 128, True, (True, True)), "deepseek_v3": (8, 2, 32, True, (False, True)),
           "deepseek_v2": (8, 2, 32, False, (False, True))}.get(name, (0, 0, 0, False, (False,) * config.num_layers))
    assert (config.num_experts, config.experts_per_token, config.moe_intermediate_size, config.norm_topk_prob, config.moe_layers) == moe
    routing = {"deepseek_v3": ("sigmoid", 4, 2, 2.5, 1), "deepseek_v2": ("softmax", 4, 2, 2.0, 2)}.get(name, ("softmax", 1, 1, 1.0, 0))
    assert (config.router_scoring, config.expert_groups, config.expert_groups_kept, config.routed_scaling_factor, config.shared_experts) == routing
    mla = {"deepseek_v3": (32, 32, 16, 24, True), "deepseek_v2": (32, None, 16, 24, True)}.get(name, (0, None, 0, 0, False))
    assert (config.kv_lora_rank, config.q_lora_rank, config.qk_nope_head_dim, config.v_head_dim, config.rope_interleaved) == mla
    if name == "gemma3":  # the global layers' RoPE (scaled), the local layers' own base
        assert (config.rope_theta, config.rope_scaling, config.local_rope_theta) == (1e6, {"rope_type": "linear", "factor": 2.0}, 1e4)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["fused-cpu-kernels", "torch-ops"])
def test_hf_checkpoint_matches_transformers(checkpoint, reference, cpu_kernels):
    """float32 logits of the prefill and 16 decode steps within 1e-4 of transformers', and the same greedy tokens."""
    prompt, ref_tokens, ref_logits = reference
    config = load_config(checkpoint[1])
    model = DecoderModel.from_path(checkpoint[1], torch.float32, "cpu", cpu_kernels_allowed=cpu_kernels)
    group = config.num_heads // config.num_kv_heads
    # latent attention refuses the fused kernels (their paged attention reads K/V heads): torch ops
    assert model.cpu_kernels == (cpu_kernels and cpu_kernel_ops.available(torch.float32, 64, group) and not config.kv_lora_rank)
    tokens, logits = greedy(model, prompt, NEW_TOKENS)
    assert (logits[:17] - ref_logits[:17]).abs().max() < 1e-4
    assert tokens == ref_tokens


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["fused-cpu-kernels", "torch-ops"])
def test_a_prompt_prefilled_in_chunks_gives_transformers_logits(checkpoint, reference, cpu_kernels):
    """The prompt in chunks of 12 (a later chunk reads its context back from the cache, through the
    window where there is one): the last chunk's logits within 1e-4 of transformers' prefill logits."""
    prompt, _, ref_logits = reference
    model = DecoderModel.from_path(checkpoint[1], torch.float32, "cpu", cpu_kernels_allowed=cpu_kernels)
    blocks = -(-len(prompt) // BLOCK_SIZE)
    cache = PagedKVCache(model.config, blocks + 1, BLOCK_SIZE, model.dtype, "cpu")
    table = list(range(blocks, 0, -1))
    for start in range(0, len(prompt), 12):
        logits = model.forward(build_forward_batch([(prompt[start : start + 12], start, table, True)], BLOCK_SIZE, "cpu"), cache)[0]
    assert (logits - ref_logits[0]).abs().max() < 1e-4


@pytest.mark.parametrize("checkpoint", ["phi3"], indirect=True)
def test_longrope_tables_past_the_original_length_use_the_long_factors(checkpoint):
    """Phi-3's ``longrope``: positions below ``original_max_position_embeddings`` rotate as transformers'
    short-factor frequencies, those from it on as its long-factor ones (``_compute_longrope_parameters``
    with a longer ``seq_len``), both scaled by its attention factor; the half of each head past
    ``rotary_dim`` is not rotated."""
    path = checkpoint[1]
    hf_config = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).config
    config = load_config(path)
    cos, signed_sin = rope_tables(config, torch.float32, "cpu")
    for seq_len, positions in ((128, torch.arange(0, 128)), (512, torch.arange(128, 512))):
        inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu", seq_len=seq_len)
        angles = positions[:, None].float() * inv_freq  # [P, 16]
        assert scale > 1 and torch.allclose(cos[positions, :16], angles.cos() * scale, atol=1e-5)
        assert torch.allclose(signed_sin[positions, 32:48], angles.sin() * scale, atol=1e-5)
    assert (cos[:, 16:32] == 1).all() and (signed_sin[:, 16:32] == 0).all() and (signed_sin[:, 48:] == 0).all()


def write_gguf(checkpoint: Path, path: Path, arch: str, linears: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    """The checkpoint's float32 weights as a GGUF file as llama.cpp's ``convert_hf_to_gguf.py`` writes
    them: Qwen3 as ``qwen3`` (Q/K rows as they are), Mistral as ``llama`` (``LlamaModel``: Q/K rows
    permuted for GGML's adjacent-pair RoPE, ``LlamaModel.permute``), its window as
    ``llama.attention.sliding_window`` where it has one; Phi-3 as ``phi3`` (``Phi3MiniModel``: fused
    ``attn_qkv`` and ``ffn_up``, no key length, ``rope.dimension_count`` the rotating values, the
    LongRoPE factors as tensors with the original context length and attention factor); Gemma 2 and
    Gemma 3 as ``gemma2`` / ``gemma3`` (``Gemma2Model``, ``Gemma3Model``: every norm weight + 1, the
    sandwich norms as ``attn_post_norm`` / ``ffn_norm`` / ``ffn_post_norm``, the window and caps as keys,
    Gemma 3's global RoPE base and scaling; no layer pattern, softmax scale or local base); Qwen3-MoE
    as ``qwen3moe`` and Mixtral as ``llama`` (``Qwen3MoeModel``, ``LlamaModel``): the experts stacked
    as ``ffn_{gate,up,down}_exps`` [experts, out, in], the router as ``ffn_gate_inp`` (kept float32, as
    ``llama-quantize`` keeps it), ``expert_count`` / ``expert_used_count`` (and Qwen3-MoE's
    ``expert_feed_forward_length``); DeepSeek as ``deepseek2`` (``DeepseekV2Model``: one KV head whose key
    and value lengths are the latent's, a head's as ``key_length_mla`` / ``value_length_mla``,
    ``kv_b_proj`` split into ``attn_k_b`` (transposed) and ``attn_v_b``, the shared experts as
    ``ffn_*_shexp``, the correction bias as ``exp_probs_b.bias``, the routing keys, YaRN's
    ``mscale_all_dim`` as ``yarn_log_multiplier``; rotated rows as they are). ``linears``: the block type of the layers' 2-D weights and expert
    stacks (``gguf.quants.quantize``)."""
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    c = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(1 if arch == "deepseek2" else c.num_key_value_heads)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # Gemma 3: the global layers'
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_eos_token_id(c.eos_token_id)
    if arch == "phi3":
        rope = c.rope_parameters
        writer.add_rope_dimension_count(int(c.hidden_size // c.num_attention_heads * rope["partial_rotary_factor"]))
        writer.add_sliding_window(c.sliding_window or 0)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        factor = c.max_position_embeddings / rope["original_max_position_embeddings"]
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(rope["original_max_position_embeddings"])))
        writer.add_tensor("rope_factors_long.weight", torch.tensor(rope["long_factor"]).numpy())
        writer.add_tensor("rope_factors_short.weight", torch.tensor(rope["short_factor"]).numpy())
    elif arch == "deepseek2":
        writer.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        writer.add_value_length(c.kv_lora_rank)
        writer.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        writer.add_value_length_mla(c.v_head_dim)
        writer.add_rope_dimension_count(c.qk_rope_head_dim)
        writer.add_kv_lora_rank(c.kv_lora_rank)
        if c.q_lora_rank is not None:
            writer.add_q_lora_rank(c.q_lora_rank)
        writer.add_leading_dense_block_count(c.first_k_dense_replace)
        writer.add_expert_count(c.n_routed_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
        writer.add_expert_shared_count(c.n_shared_experts)
        writer.add_expert_weights_scale(c.routed_scaling_factor)
        writer.add_expert_weights_norm(bool(c.norm_topk_prob))
        sigmoid = c.model_type == "deepseek_v3"
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
        writer.add_expert_group_count(c.n_group)
        writer.add_expert_group_used_count(c.topk_group)
        if rope["rope_type"] == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    else:
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        writer.add_rope_dimension_count(c.head_dim)
        if getattr(c, "sliding_window", None):
            writer.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if getattr(c, "num_local_experts", None) and arch != "deepseek2":  # Qwen3MoeConfig's num_experts is the same attribute
        writer.add_expert_count(c.num_local_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "gemma3" and rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                   "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
                   "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                   "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused ones
                   "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
                   "mlp.experts.down_proj": "ffn_down_exps",  # a mixture of experts' router and stacked experts
                   "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
                   "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
                   "self_attn.k_b_proj": "attn_k_b", "self_attn.v_b_proj": "attn_v_b", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
                   "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}  # DeepSeek's
    if arch.startswith("gemma"):  # llama.cpp's names of the sandwich norms
        layer_names |= {"post_attention_layernorm": "attn_post_norm", "pre_feedforward_layernorm": "ffn_norm",
                        "post_feedforward_layernorm": "ffn_post_norm"}
    for i in range(c.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{ours}.weight" for hf, ours in layer_names.items()}
    state = hf.state_dict()
    for key in [k for k in state if k.endswith("mlp.experts.gate_up_proj")]:  # transformers 5's fused experts [E, 2 * I, H]
        prefix = key.removesuffix("gate_up_proj")
        state[prefix + "gate_proj.weight"], state[prefix + "up_proj.weight"] = (t.contiguous() for t in state.pop(key).chunk(2, dim=1))
        state[prefix + "down_proj.weight"] = state.pop(prefix + "down_proj")
    for key in [k for k in state if k.endswith("kv_b_proj.weight")]:  # DeepSeek's, split as llama.cpp's converter does
        kv_b = state.pop(key).view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        state[key.replace("kv_b", "k_b")] = kv_b[:, : c.qk_nope_head_dim].transpose(1, 2).contiguous()  # [H, r, nope]
        state[key.replace("kv_b", "v_b")] = kv_b[:, c.qk_nope_head_dim :].contiguous()  # [H, v, r]
    for i in range(c.num_hidden_layers):
        names[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = f"blk.{i}.exp_probs_b.bias"
    assert c.tie_word_embeddings and set(state) - set(names) <= {"lm_head.weight"}
    for hf_name, gguf_name in names.items():
        if hf_name not in state:
            continue  # each family has only some of these
        tensor = state[hf_name]
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            tensor = tensor + 1  # Gemma's (1 + w) RMSNorm, stored as its multiplier
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in gguf_name else c.num_key_value_heads
            tensor = tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, tensor.shape[1]).swapaxes(1, 2).reshape(tensor.shape)
        # the router and llama.cpp's 3-D attn_k_b / attn_v_b (kept F32/F16 by llama-quantize's rules for small tensors) stay float
        quantized = tensor.dim() >= 2 and gguf_name.startswith("blk.") and not any(n in gguf_name for n in ("ffn_gate_inp", "attn_k_b", "attn_v_b"))
        if quantized and linears != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(tensor.numpy(), linears), raw_dtype=linears)
        else:
            writer.add_tensor(gguf_name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("checkpoint", list(GGUF_ARCHITECTURES), indirect=True)
def test_gguf_gives_transformers_tokens(checkpoint, reference, tmp_path):
    """The same weights written as GGUF load to the same config (Qwen3's ``attn_q_norm``/``attn_k_norm``
    and ``qwen3.attention.key_length``; Mistral as ``llama``, with its window; Phi-3's fused tensors,
    rotary dimension and LongRoPE factors; Gemma's norms stored + 1, its sandwich norms, caps, and
    the layer pattern, scales and local RoPE base llama.cpp derives from the architecture) and give
    transformers' greedy tokens, logits within 1e-4. Qwen3-MoE and Mixtral: their experts, routers and
    dense layers (those without ``ffn_gate_inp``). DeepSeek: the latent attention's shapes, the split
    ``kv_b_proj``, the routing keys and the YaRN softmax scale."""
    name, directory = checkpoint
    prompt, ref_tokens, ref_logits = reference
    arch = GGUF_ARCHITECTURES[name]
    model = DecoderModel.from_path(write_gguf(directory, tmp_path / f"{name}.gguf", arch), torch.float32, "cpu")
    hf_config = load_config(directory)
    assert model.config.architecture == ("llama" if arch == "llama" else hf_config.architecture)
    fields = ("head_dim", "qk_norm", "sliding_window", "rotary_dim", "num_kv_heads", "intermediate_size", "hidden_act",
              "sandwich_norms", "embed_scale", "attn_softcap", "final_softcap", "layer_windows", "local_rope_theta",
              "num_experts", "experts_per_token", "moe_intermediate_size", "norm_topk_prob", "moe_layers", "router_scoring", "expert_groups",
              "expert_groups_kept", "routed_scaling_factor", "shared_experts", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim",
              "rope_interleaved")
    assert [getattr(model.config, f) for f in fields] == [getattr(hf_config, f) for f in fields]
    assert model.config.softmax_scale == pytest.approx(hf_config.softmax_scale, rel=1e-6)  # DeepSeek's mscale through a float32 0.1 x mscale_all_dim
    if hf_config.rope_scaling and hf_config.rope_scaling["rope_type"] == "longrope":
        assert model.config.rope_scaling["short_factor"] == pytest.approx(hf_config.rope_scaling["short_factor"])
        assert model.config.rope_scaling["long_factor"] == pytest.approx(hf_config.rope_scaling["long_factor"])
    else:
        assert model.config.rope_scaling == (hf_config.rope_scaling and {k: pytest.approx(v, rel=1e-6) if isinstance(v, float) else v
                                                                         for k, v in hf_config.rope_scaling.items()})
    tokens, logits = greedy(model, prompt, NEW_TOKENS)
    assert (logits[:17] - ref_logits[:17]).abs().max() < 1e-4
    assert tokens == ref_tokens


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"},
         r"config\.json: unsupported model_type 'gpt2' \(supported: deepseek_v2, deepseek_v3, gemma2, gemma3, gemma3_text, llama, mistral, "
         r"mixtral, phi3, qwen2, qwen3, qwen3_moe\)"),
        ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 10000.0}},
         r"config\.json: unsupported rope_type 'mrope' \(supported: default, linear, dynamic, llama3, yarn, longrope\)"),
        ({"hidden_act": "relu"}, r"config\.json: unsupported hidden_act 'relu' \(supported: silu, gelu_pytorch_tanh\)"),
        ({"model_type": "gemma2", "hidden_activation": "gelu"},
         r"config\.json: unsupported hidden_activation 'gelu' \(supported: silu, gelu_pytorch_tanh\)"),
        ({"model_type": "gemma2", "layer_types": ["chunked_attention"]},
         r"config\.json: unsupported layer_types value 'chunked_attention' \(supported: full_attention, sliding_attention\)"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True},
         r"config\.json: unsupported use_bidirectional_attention True \(supported: false\)"),
        ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "default"},
                                                           "sliding_attention": {"rope_type": "yarn", "factor": 2.0}}},
         r"config\.json: unsupported rope_parameters\.sliding_attention rope_type 'yarn' \(supported: default\)"),
        ({"model_type": "gemma3", "text_config": {"model_type": "gemma3n_text"}},
         r"config\.json: unsupported text_config\.model_type 'gemma3n_text' \(supported: gemma3_text\)"),
        ({"model_type": "qwen2", "use_sliding_window": True}, r"config\.json: unsupported use_sliding_window True \(supported: false\)"),
        ({"mlp_bias": True}, r"config\.json: unsupported mlp_bias True \(supported: false\)"),
        ({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 1.0]},
          "original_max_position_embeddings": 16}, r"config\.json: rope_parameters 'short_factor' must hold 2 values"),
        ({"model_type": "deepseek_v2", "qk_rope_head_dim": 2, "topk_method": "noaux_tc"},
         r"config\.json: unsupported scoring_func / topk_method 'softmax' / 'noaux_tc' \(supported: softmax / greedy, "
         r"softmax / group_limited_greedy, sigmoid / noaux_tc\)"),
        ({"model_type": "deepseek_v3", "qk_rope_head_dim": 2, "attention_bias": True},
         r"config\.json: unsupported attention_bias True \(supported: false\)"),
    ],
    ids=["architecture", "rope-type", "activation", "gemma-activation", "layer-type", "bidirectional", "local-rope-type",
         "multimodal-text-model", "qwen2-sliding-window", "mlp-bias", "longrope-factors", "deepseek-router", "deepseek-attention-bias"],
)
def test_what_is_not_supported_is_refused_naming_the_file_field_and_supported_values(tmp_path, change, message):
    """The device exits 2 with this message (``test_an_unloadable_model_exits_with_code_2_naming_the_file``)."""
    directory = tmp_path / "model"
    directory.mkdir()
    raw = {"model_type": "mistral", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2}
    (directory / "config.json").write_text(json.dumps(raw | change))
    with pytest.raises(ModelLoadError, match=message):
        load_config(directory)


@pytest.mark.parametrize("checkpoint", ["phi3"], indirect=True)
def test_a_q8_0_phi3_gguf_splits_its_fused_blocks_and_runs_them_on_int8_kernels(checkpoint, reference, tmp_path):
    """Phi-3's fused ``attn_qkv``/``ffn_up`` in Q8_0 split by rows of blocks into parts that dequantize
    to what the dequantizing load gives; kept quantized (``--weights auto``), with the q/k rows
    reordered for partial rotary, every layer linear runs int8 and gives the dequantized model's
    greedy tokens (Q8_0 rounding itself changes this random model's tokens from transformers')."""
    prompt = reference[0]
    path = write_gguf(checkpoint[1], tmp_path / "phi3-q8_0.gguf", "phi3", gguf.GGMLQuantizationType.Q8_0)
    _, kept = load_weights(path, torch.float32, keep_quantized=True)
    _, dense = load_weights(path, torch.float32)
    for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
        part = kept[f"model.layers.1.{name}.weight"]
        assert isinstance(part, QuantizedWeight) and torch.equal(part.dequantize(), dense[f"model.layers.1.{name}.weight"])
    if not cpu_kernel_ops.has_avx512_vnni():
        pytest.skip("float32 int8 linears run on the VNNI kernel; without it the device keeps float32 weights dense")
    model = DecoderModel.from_path(path, torch.float32, "cpu", weight_format="auto")
    assert model.linear_formats["int8"] == 4 * model.config.num_layers
    tokens, logits = greedy(model, prompt, NEW_TOKENS)
    ref_tokens, ref_logits = greedy(DecoderModel.from_path(path, torch.float32, "cpu"), prompt, NEW_TOKENS)
    assert (logits - ref_logits).abs().max() < 1e-2  # int8 activations (measured 3e-3)
    assert tokens == ref_tokens


@pytest.mark.parametrize("checkpoint", ["qwen3_moe"], indirect=True)
def test_a_q8_0_moe_gguf_keeps_its_experts_quantized_on_int8_kernels(checkpoint, reference, tmp_path):
    """Qwen3-MoE's ``ffn_*_exps`` stacks in Q8_0 split by rows of blocks into each expert's weight,
    which dequantizes to what the dequantizing load gives; kept quantized (``--weights auto``), every
    expert's linears and the dense layer's run int8 (the routers, float32 in the file, stay float32) and
    give the dequantized model's greedy tokens."""
    prompt = reference[0]
    path = write_gguf(checkpoint[1], tmp_path / "qwen3_moe-q8_0.gguf", "qwen3moe", gguf.GGMLQuantizationType.Q8_0)
    _, kept = load_weights(path, torch.float32, keep_quantized=True)
    _, dense = load_weights(path, torch.float32)
    for name in ("experts.0.gate_proj", "experts.3.up_proj", "experts.7.down_proj"):
        part = kept[f"model.layers.1.mlp.{name}.weight"]
        assert isinstance(part, QuantizedWeight) and torch.equal(part.dequantize(), dense[f"model.layers.1.mlp.{name}.weight"])
    model = DecoderModel.from_path(path, torch.float32, "cpu", weight_format="auto")
    c = model.config
    assert model.linear_formats["int8"] == 2 * c.num_layers + 2 + 2 * c.num_experts  # q/k/v + o, the dense MLP, the experts
    # the tied head (float32 embeddings); the routers are float32 too: dense linears where no CPU kernel routes
    assert model.linear_formats["float32"] == 1 + (not model.cpu_kernels)
    tokens, logits = greedy(model, prompt, NEW_TOKENS)
    ref_tokens, ref_logits = greedy(DecoderModel.from_path(path, torch.float32, "cpu"), prompt, NEW_TOKENS)
    # int8 activations (the VNNI kernel), or weights requantized to one scale per row (torch's: 0.13 measured)
    assert (logits - ref_logits).abs().max() < 0.25
    assert tokens == ref_tokens


@pytest.mark.parametrize("checkpoint", ["mixtral"], indirect=True)
def test_transformers_fused_expert_parameters_load_as_each_experts_weights(checkpoint, tmp_path):
    """A checkpoint of transformers 5's in-memory layout (``MixtralExperts.gate_up_proj`` [E, 2I, H],
    ``down_proj`` [E, H, I], ``mlp.gate``) loads to the weights of the per-expert one it saves."""
    directory = checkpoint[1]
    fused = tmp_path / "mixtral-fused"
    fused.mkdir()
    (fused / "config.json").write_text((directory / "config.json").read_text())
    state = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, fused / "model.safetensors")
    config, weights = load_weights(fused, torch.float32)
    assert (config, weights.keys()) == (load_config(directory), load_weights(directory, torch.float32)[1].keys())
    reference = load_weights(directory, torch.float32)[1]
    assert all(torch.equal(weights[name], reference[name]) for name in reference)


def test_qwen3_moe_dense_layers_are_transformers_ones(tmp_path):
    """``mlp_only_layers`` and ``decoder_sparse_step`` make the layers transformers builds dense
    (``Qwen3MoeDecoderLayer``) dense here too; a config of Qwen's own keys (``num_experts``) reads as one
    transformers saved (``num_local_experts``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    raw = {"model_type": "qwen3_moe", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "moe_intermediate_size": 4,
           "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "num_experts": 4,
           "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{k: v for k, v in raw.items() if k != "model_type"}))
    config = load_config(tmp_path)
    assert config.moe_layers == tuple(isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers)
    assert config.moe_layers == (False, True, False, False, False, True) and config.num_experts == 4


@pytest.mark.parametrize("checkpoint", ["gemma3"], indirect=True)
def test_a_multimodal_gemma3_checkpoint_serves_its_language_model(checkpoint, reference, tmp_path):
    """A ``gemma3`` config (``Gemma3ForConditionalGeneration``) loads its ``text_config`` and its
    ``model.language_model.*`` tensors (the vision tower's are not loaded) and gives the text model's
    tokens and logits."""
    directory = checkpoint[1]
    prompt, ref_tokens, ref_logits = reference
    multimodal = tmp_path / "gemma3-multimodal"
    multimodal.mkdir()
    text = json.loads((directory / "config.json").read_text())
    (multimodal / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "text_config": text, "vision_config": {"model_type": "siglip_vision_model"}, "eos_token_id": [256]}))
    tensors = {"model.language_model." + n.removeprefix("model."): t for n, t in load_file(directory / "model.safetensors").items()}
    save_file(tensors | {"model.vision_tower.vision_model.post_layernorm.weight": torch.ones(4)}, multimodal / "model.safetensors")
    model = DecoderModel.from_path(multimodal, torch.float32, "cpu")
    assert model.config == load_config(directory)
    tokens, logits = greedy(model, prompt, NEW_TOKENS)
    assert (logits[:17] - ref_logits[:17]).abs().max() < 1e-4
    assert tokens == ref_tokens


def test_a_gemma3_config_that_omits_keys_reads_them_as_transformers_does(tmp_path):
    """Google's multimodal configs give only some of the text model's keys (this one is gemma-3-4b-it's
    ``text_config``): the rest take ``Gemma3TextConfig``'s defaults, as transformers reads them."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}))
    ours, hf = load_config(tmp_path), AutoConfig.from_pretrained(str(tmp_path)).text_config
    assert (ours.vocab_size, ours.num_heads, ours.num_kv_heads, ours.head_dim, ours.max_position_embeddings) == (
        hf.vocab_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.max_position_embeddings)
    assert ours.softmax_scale == hf.query_pre_attn_scalar**-0.5 and ours.eos_token_ids == (1, 106)
    assert ours.layer_windows == tuple(1024 if t == "sliding_attention" else None for t in hf.layer_types)
    global_rope, local_rope = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (ours.rope_theta, ours.rope_scaling, ours.local_rope_theta) == (
        global_rope["rope_theta"], {"rope_type": "linear", "factor": 8.0}, local_rope["rope_theta"])


@pytest.mark.parametrize("checkpoint", DEEPSEEK, indirect=True)
def test_latent_attention_pools_the_latent_shared_by_all_heads(checkpoint, reference):
    """The KV pool of a latent-attention model holds ``layers x (kv_lora_rank + qk_rope_head_dim)``
    values per token (not the heads' expanded keys and values), and what a prefill writes there is
    what transformers' cache keeps for the same tokens (a bfloat16 pool: half the bytes, the router's
    correction bias still float32, as transformers keeps it): the normed latent and the rotated shared key
    (``DeepseekV3Attention``'s ``cache.update(kv_nope, k_rot)``; the rotated values in the order V3's
    ``apply_rotary_pos_emb_interleave`` writes them: evens, then odds; V2's complex RoPE keeps the pairs)."""
    prompt = reference[0]
    model = DecoderModel.from_path(checkpoint[1], torch.float32, "cpu")
    c = model.config
    for dtype in (torch.float32, torch.bfloat16):
        pool = PagedKVCache(c, 4, BLOCK_SIZE, dtype, "cpu")
        if dtype == torch.bfloat16:
            half = DecoderModel.from_path(checkpoint[1], dtype, "cpu")
            assert all(layer.moe.bias.dtype == torch.float32 for layer in half.layers if layer.moe is not None and c.router_scoring == "sigmoid")
            assert half.forward(build_forward_batch([(prompt, 0, [1, 2, 3], True)], BLOCK_SIZE, "cpu"), pool).isfinite().all()
        per_token = pool.kv.numel() * pool.kv.element_size() // (4 * BLOCK_SIZE)
        assert per_token == bytes_per_block(c, BLOCK_SIZE, dtype) // BLOCK_SIZE == c.num_layers * (32 + 16) * dtype.itemsize
    blocks = -(-len(prompt) // BLOCK_SIZE)
    pool = PagedKVCache(c, blocks + 1, BLOCK_SIZE, torch.float32, "cpu")
    table = list(range(blocks, 0, -1))
    model.forward(build_forward_batch([(prompt, 0, table, True)], BLOCK_SIZE, "cpu"), pool)
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint[1]), dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(len(prompt))])
    for index, layer in enumerate(cache.layers):
        k_rot = layer.values[0, 0] if checkpoint[0] == "deepseek_v3" else layer.values[0, 0][:, interleaved_row_order(16)]
        expected = torch.cat((layer.keys[0, 0], k_rot), -1)  # [L, r + rope]
        assert (pool.gather_entries(index, slots)[0] - expected).abs().max() < 1e-5


@pytest.mark.parametrize("checkpoint", DEEPSEEK, indirect=True)
def test_a_prefix_cache_hit_on_latent_attention_gives_the_uncached_tokens(checkpoint, reference):
    """Sequence A prefills the prompt's first two blocks; sequence B starts from those blocks (a
    prefix-cache hit: it prefills only the rest, reading the cached latents back, in the step of A's
    first decode row) and decodes in the same steps as A (decode rows of different lengths in one
    batch): B gives transformers' tokens for the whole prompt, A the tokens it gives alone."""
    prompt, ref_tokens, _ = reference
    model = DecoderModel.from_path(checkpoint[1], torch.float32, "cpu")
    cached = 2 * BLOCK_SIZE
    alone, _ = greedy(model, prompt[:cached], NEW_TOKENS)
    pool = PagedKVCache(model.config, 12, BLOCK_SIZE, model.dtype, "cpu")
    table_a, table_b = [5, 3, 10, 11], [5, 3, 7, 8, 9]
    a = [int(model.forward(build_forward_batch([(prompt[:cached], 0, table_a, True)], BLOCK_SIZE, "cpu"), pool)[0].argmax())]
    rows = [([a[-1]], cached, table_a, True), (prompt[cached:], cached, table_b, True)]
    logits = model.forward(build_forward_batch(rows, BLOCK_SIZE, "cpu"), pool)
    a.append(int(logits[0].argmax()))
    b = [int(logits[1].argmax())]
    for _ in range(NEW_TOKENS - 1):
        rows = [([a[-1]], cached + len(a) - 1, table_a, True), ([b[-1]], len(prompt) + len(b) - 1, table_b, True)]
        logits = model.forward(build_forward_batch(rows, BLOCK_SIZE, "cpu"), pool)
        a.append(int(logits[0].argmax()))
        b.append(int(logits[1].argmax()))
    assert b == ref_tokens
    assert a[:NEW_TOKENS] == alone


@pytest.mark.parametrize("checkpoint", ["deepseek_v3"], indirect=True)
def test_a_q8_0_deepseek_gguf_runs_its_latent_attention_and_experts_on_int8_kernels(checkpoint, reference, tmp_path):
    """DeepSeek-V3 in Q8_0 kept quantized (``--weights auto``): the latent attention's linears
    (``q_a``, ``q_b`` with its rotated rows reordered by rows of blocks, ``kv_a``, ``o``), the dense
    layer's MLP, the experts and the shared experts run int8 (the router, the tied head and llama.cpp's
    float ``attn_k_b`` / ``attn_v_b``, joined into the dense up-projections, stay float32) and give the
    dequantized model's greedy tokens."""
    prompt = reference[0]
    path = write_gguf(checkpoint[1], tmp_path / "deepseek-q8_0.gguf", "deepseek2", gguf.GGMLQuantizationType.Q8_0)
    model = DecoderModel.from_path(path, torch.float32, "cpu", weight_format="auto")
    c = model.config
    assert model.linear_formats["int8"] == 4 * c.num_layers + 2 + 2 * c.num_experts + 2
    assert model.linear_formats["float32"] == 1 + 1
    tokens, logits = greedy(model, prompt, NEW_TOKENS)
    ref_tokens, ref_logits = greedy(DecoderModel.from_path(path, torch.float32, "cpu"), prompt, NEW_TOKENS)
    assert (logits - ref_logits).abs().max() < 0.25  # int8 activations or per-row requantized weights, as Qwen3-MoE's
    assert tokens == ref_tokens
