"""Model families: the registry, and each family added through ``services/device/model/README.md``'s
steps (Qwen3, Mistral with and without a sliding window, Phi-3) computing what transformers computes,
from a Hugging Face directory, on the fused CPU kernels and on plain torch ops, and from the same
weights as GGUF."""

from __future__ import annotations

import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from stageserve.device.kernels import cpu_kernels as cpu_kernel_ops
from stageserve.device.model import family
from stageserve.device.model.decoder import DecoderModel
from stageserve.device.model.forward_batch import build_forward_batch
from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.rope import rope_tables
from stageserve.device.kernels.quant import QuantizedWeight
from stageserve.device.model.weights import ModelLoadError, load_config, load_weights
from tests.tiny_checkpoint import write_tiny_checkpoint
from tests.unit.device.test_model_reference import BLOCK_SIZE, greedy, hf_greedy

NEW_TOKENS = 24  # a prefill and 23 decode steps; logits are compared over the prefill and 16 decode steps
PROMPT_LENGTH = 40  # 5 windows of Mistral's 8 tokens
WINDOW = 8

# id -> write_tiny_checkpoint arguments
CHECKPOINTS = {
    "qwen3": {"family": "qwen3"},
    "mistral": {"family": "mistral"},
    "mistral-window": {"family": "mistral", "sliding_window": WINDOW},
    "phi3": {"family": "phi3"},
}
GGUF_ARCHITECTURES = {"qwen3": "qwen3", "mistral": "llama", "mistral-window": "llama", "phi3": "phi3"}  # as llama.cpp writes them


def test_every_family_is_registered_under_its_hf_and_gguf_names():
    assert [f.name for f in family.families()] == ["llama", "mistral", "phi3", "qwen2", "qwen3"]
    assert family.hf_model_types() == ("llama", "mistral", "phi3", "qwen2", "qwen3")
    assert family.gguf_architectures() == ("llama", "phi3", "qwen2", "qwen3")  # llama.cpp writes Mistral as llama
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
    }[name]
    assert (config.architecture, config.head_dim, config.qk_norm, config.sliding_window, config.rotary_dim) == expected
    assert not config.attention_bias
    if name == "phi3":
        assert config.rope_scaling["rope_type"] == "longrope" and config.rope_scaling["original_max_position_embeddings"] == 128


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["fused-cpu-kernels", "torch-ops"])
def test_hf_checkpoint_matches_transformers(checkpoint, reference, cpu_kernels):
    """float32 logits of the prefill and 16 decode steps within 1e-4 of transformers', and the same greedy tokens."""
    prompt, ref_tokens, ref_logits = reference
    config = load_config(checkpoint[1])
    model = DecoderModel.from_path(checkpoint[1], torch.float32, "cpu", cpu_kernels_allowed=cpu_kernels)
    group = config.num_heads // config.num_kv_heads
    assert model.cpu_kernels == (cpu_kernels and cpu_kernel_ops.available(torch.float32, 64, group))
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
    LongRoPE factors as tensors with the original context length and attention factor). ``linears``:
    the block type of the layers' 2-D weights (``gguf.quants.quantize``)."""
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    c = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
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
    else:
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
        writer.add_rope_dimension_count(c.head_dim)
        if getattr(c, "sliding_window", None):
            writer.add_sliding_window(c.sliding_window)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    layer_names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                   "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
                   "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
                   "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # Phi-3's fused ones
    for i in range(c.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{ours}.weight" for hf, ours in layer_names.items()}
    state = hf.state_dict()
    assert c.tie_word_embeddings and set(state) - set(names) <= {"lm_head.weight"}
    for hf_name, gguf_name in names.items():
        if hf_name not in state:
            continue  # each family has only some of these
        tensor = state[hf_name]
        if arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in gguf_name else c.num_key_value_heads
            tensor = tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, tensor.shape[1]).swapaxes(1, 2).reshape(tensor.shape)
        if tensor.dim() == 2 and gguf_name.startswith("blk.") and linears != gguf.GGMLQuantizationType.F32:
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
    rotary dimension and LongRoPE factors) and give transformers' greedy tokens, logits within 1e-4."""
    name, directory = checkpoint
    prompt, ref_tokens, ref_logits = reference
    arch = GGUF_ARCHITECTURES[name]
    model = DecoderModel.from_path(write_gguf(directory, tmp_path / f"{name}.gguf", arch), torch.float32, "cpu")
    hf_config = load_config(directory)
    assert model.config.architecture == ("llama" if arch == "llama" else name)
    fields = ("head_dim", "qk_norm", "sliding_window", "rotary_dim", "num_kv_heads", "intermediate_size")
    assert [getattr(model.config, f) for f in fields] == [getattr(hf_config, f) for f in fields]
    if hf_config.rope_scaling:
        assert model.config.rope_scaling["short_factor"] == pytest.approx(hf_config.rope_scaling["short_factor"])
        assert model.config.rope_scaling["long_factor"] == pytest.approx(hf_config.rope_scaling["long_factor"])
    tokens, logits = greedy(model, prompt, NEW_TOKENS)
    assert (logits[:17] - ref_logits[:17]).abs().max() < 1e-4
    assert tokens == ref_tokens


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gemma2"}, r"config\.json: unsupported model_type 'gemma2' \(supported: llama, mistral, phi3, qwen2, qwen3\)"),
        ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 10000.0}},
         r"config\.json: unsupported rope_type 'mrope' \(supported: default, linear, dynamic, llama3, yarn, longrope\)"),
        ({"hidden_act": "gelu_pytorch_tanh"}, r"config\.json: unsupported hidden_act 'gelu_pytorch_tanh' \(only silu\)"),
        ({"model_type": "qwen2", "use_sliding_window": True}, r"config\.json: unsupported use_sliding_window True \(supported: false\)"),
        ({"mlp_bias": True}, r"config\.json: unsupported mlp_bias True \(supported: false\)"),
        ({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0, 1.0]},
          "original_max_position_embeddings": 16}, r"config\.json: rope_parameters 'short_factor' must hold 2 values"),
    ],
    ids=["architecture", "rope-type", "activation", "qwen2-sliding-window", "mlp-bias", "longrope-factors"],
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
    model = DecoderModel.from_path(path, torch.float32, "cpu", weight_format="auto")
    assert model.linear_formats["int8"] == 4 * model.config.num_layers
    tokens, logits = greedy(model, prompt, NEW_TOKENS)
    ref_tokens, ref_logits = greedy(DecoderModel.from_path(path, torch.float32, "cpu"), prompt, NEW_TOKENS)
    assert (logits - ref_logits).abs().max() < 1e-2  # int8 activations (measured 3e-3)
    assert tokens == ref_tokens
