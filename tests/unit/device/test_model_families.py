"""Model families: the registry, and Qwen3 (added through ``services/device/model/README.md``'s steps)
computing what transformers computes, from a Hugging Face directory and from the same weights as GGUF."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from stageserve.device.kernels import cpu_kernels as cpu_kernel_ops
from stageserve.device.model import family
from stageserve.device.model.decoder import DecoderModel
from stageserve.device.model.weights import load_config
from tests.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.device.test_model_reference import greedy, hf_greedy

NEW_TOKENS = 24  # a prefill and 23 decode steps; logits are compared over the prefill and 16 decode steps


def test_every_family_is_registered_under_its_hf_and_gguf_names():
    assert [f.name for f in family.families()] == ["llama", "qwen2", "qwen3"]
    assert family.hf_model_types() == ("llama", "qwen2", "qwen3") == family.gguf_architectures()
    assert family.family_for_hf("qwen3").name == "qwen3" and family.family_for_gguf("qwen3").name == "qwen3"
    assert family.family_for_hf("gpt2") is None and family.family_for_gguf("gpt2") is None
    assert family.family_named("llama").gguf_qk_permuted and not family.family_named("qwen3").gguf_qk_permuted


def test_a_name_claimed_twice_is_refused():
    with pytest.raises(ValueError, match=r"qwen3 already registered by 'qwen3'"):
        family.register(family.Family("qwen3-copy", ("qwen3",), (), lambda raw: {}))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen3 written by transformers: head_dim 64 (hidden 64 / 4 heads would be 16; 64 runs the fused CPU kernels), q/k norms drawn around 1."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), family="qwen3")


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    """transformers' greedy tokens and per-step float32 logits for a fixed prompt."""
    torch.manual_seed(0)
    prompt = torch.randint(3, 257, (40,)).tolist()
    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32).eval()
    return prompt, *hf_greedy(hf, prompt, NEW_TOKENS)


def test_qwen3_config_reads_head_dim_and_qk_norm(qwen3_dir):
    config = load_config(qwen3_dir)
    assert (config.architecture, config.head_dim, config.hidden_size // config.num_heads) == ("qwen3", 64, 16)
    assert config.qk_norm and not config.attention_bias and (config.num_heads, config.num_kv_heads) == (4, 2)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["fused-cpu-kernels", "torch-ops"])
def test_qwen3_hf_checkpoint_matches_transformers(qwen3_dir, reference, cpu_kernels):
    """float32 logits of the prefill and 16 decode steps within 1e-4 of transformers', and the same greedy tokens."""
    prompt, ref_tokens, ref_logits = reference
    model = DecoderModel.from_path(qwen3_dir, torch.float32, "cpu", cpu_kernels_allowed=cpu_kernels)
    assert model.cpu_kernels == (cpu_kernels and cpu_kernel_ops.available(torch.float32, 64, 2))
    tokens, logits = greedy(model, prompt, NEW_TOKENS)
    assert (logits[:17] - ref_logits[:17]).abs().max() < 1e-4
    assert tokens == ref_tokens


def write_qwen3_gguf(qwen3_dir: Path, path: Path) -> Path:
    """The checkpoint's float32 weights as a GGUF file as llama.cpp's converter names them for ``qwen3`` (no Q/K permutation)."""
    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_dir), dtype=torch.float32)
    c = hf.config
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_eos_token_id(c.eos_token_id)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                   "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
                   "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{ours}.weight" for hf, ours in layer_names.items()}
    state = hf.state_dict()
    assert c.tie_word_embeddings and set(state) - set(names) <= {"lm_head.weight"}
    for hf_name, gguf_name in names.items():
        writer.add_tensor(gguf_name, state[hf_name].numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_qwen3_gguf_gives_transformers_tokens(qwen3_dir, reference, tmp_path):
    """The same weights written as GGUF (``attn_q_norm``/``attn_k_norm``, ``qwen3.attention.key_length``) load
    to the same config and give transformers' greedy tokens, logits within 1e-4."""
    prompt, ref_tokens, ref_logits = reference
    path = write_qwen3_gguf(qwen3_dir, tmp_path / "qwen3.gguf")
    model = DecoderModel.from_path(path, torch.float32, "cpu")
    assert (model.config.architecture, model.config.head_dim, model.config.qk_norm) == ("qwen3", 64, True)
    tokens, logits = greedy(model, prompt, NEW_TOKENS)
    assert (logits[:17] - ref_logits[:17]).abs().max() < 1e-4
    assert tokens == ref_tokens
