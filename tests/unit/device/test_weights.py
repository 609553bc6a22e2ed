"""Weight loading: GGUF dequantization and Q/K un-permutation, and clear errors for bad inputs."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from stageserve.device.model.weights import ModelLoadError, holds_quantized_linears, load_weights
from stageserve.model_files import embedded_model_path

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 2, 1, 32, 64, 96
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)  # gguf-py dequantizes these but does not quantize them


def _llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``: rotate-half rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, types: dict[str, gguf.GGMLQuantizationType] | None = None, ffn: int = FFN,
               hidden: int = HIDDEN) -> dict[str, np.ndarray]:
    """A one-layer llama GGUF like ``_write_tiny_gguf``'s with the tensor types in ``types`` changed
    (gguf name: type; K-quants get random blocks), an MLP width of ``ffn`` and a hidden size of
    ``hidden`` (the attention's width stays ``HEADS * HEAD_DIM``); the expected values."""
    return _write_tiny_gguf(path, types=types or {}, ffn=ffn, hidden=hidden)


def _random_blocks(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random bytes for a type gguf-py cannot quantize (K-quants), with every float16 factor a small finite value."""
    from tests.unit.device.test_quant import random_blocks

    return random_blocks(qtype, shape[0], shape[1], seed=int(rng.integers(2**31)))


def _write_tiny_gguf(path: Path, arch: str = "llama", types: dict | None = None, ffn: int = FFN, hidden: int = HIDDEN) -> dict[str, np.ndarray]:
    """Write a one-layer llama GGUF whose tensors use F32/F16/BF16/Q8_0/Q4_0/Q4_1.

    Returns the HF-named float32 values the loader must produce (quantization error included).
    """
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_eos_token_id(2)
    plan = {  # gguf name: (hf name, shape, type)
        "token_embd.weight": ("model.embed_tokens.weight", (VOCAB, hidden), Q.Q8_0),
        "output_norm.weight": ("model.norm.weight", (hidden,), Q.F32),
        "blk.0.attn_norm.weight": ("model.layers.0.input_layernorm.weight", (hidden,), Q.F32),
        "blk.0.ffn_norm.weight": ("model.layers.0.post_attention_layernorm.weight", (hidden,), Q.F32),
        "blk.0.attn_q.weight": ("model.layers.0.self_attn.q_proj.weight", (HEADS * HEAD_DIM, hidden), Q.Q4_0),
        "blk.0.attn_k.weight": ("model.layers.0.self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, hidden), Q.Q4_1),
        "blk.0.attn_v.weight": ("model.layers.0.self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, hidden), Q.F16),
        "blk.0.attn_output.weight": ("model.layers.0.self_attn.o_proj.weight", (hidden, HEADS * HEAD_DIM), Q.BF16),
        "blk.0.ffn_gate.weight": ("model.layers.0.mlp.gate_proj.weight", (ffn, hidden), Q.Q8_0),
        "blk.0.ffn_up.weight": ("model.layers.0.mlp.up_proj.weight", (ffn, hidden), Q.Q4_1),
        "blk.0.ffn_down.weight": ("model.layers.0.mlp.down_proj.weight", (hidden, ffn), Q.Q4_0),
    }
    plan = {name: (hf_name, shape, (types or {}).get(name, qtype)) for name, (hf_name, shape, qtype) in plan.items()}
    expected = {}
    for name, (hf_name, shape, qtype) in plan.items():
        value = rng.standard_normal(shape).astype(np.float32)
        stored = value
        if name == "blk.0.attn_q.weight":
            stored = _llamacpp_permute(value, HEADS)
        elif name == "blk.0.attn_k.weight":
            stored = _llamacpp_permute(value, KV_HEADS)
        if qtype == Q.F32:
            writer.add_tensor(name, stored)
            expected[hf_name] = value
            continue
        packed = _random_blocks(shape, qtype, rng) if qtype in K_QUANTS else quantize(stored, qtype)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
        roundtrip = dequantize(packed, qtype).reshape(shape)
        if name == "blk.0.attn_q.weight":  # un-permute the reference the same way HF does
            roundtrip = roundtrip.reshape(HEADS, HEAD_DIM // 2, 2, hidden).swapaxes(1, 2).reshape(shape)
        elif name == "blk.0.attn_k.weight":
            roundtrip = roundtrip.reshape(KV_HEADS, HEAD_DIM // 2, 2, hidden).swapaxes(1, 2).reshape(shape)
        expected[hf_name] = roundtrip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_tiny_gguf_dequantizes_every_type_and_unpermutes_qk(tmp_path):
    """F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors load bit-exactly as gguf's own dequantizer decodes them,
    and llama Q/K rows come back in HF rotate-half order (llama.cpp's permutation undone)."""
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_gguf(path)
    config, weights = load_weights(path, torch.float32)
    assert (config.architecture, config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == ("llama", 1, HEADS, KV_HEADS, HEAD_DIM)
    assert config.tie_word_embeddings and config.eos_token_ids == (2,)
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(weights[name].numpy(), value, err_msg=name)


def test_embedded_gguf_loads_with_expected_config():
    """The embedded SmolLM2-135M Q4_1 file yields its documented architecture and bf16 tensors."""
    config, weights = load_weights(embedded_model_path(), torch.bfloat16)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.vocab_size) == (30, 576, 9, 3, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert weights["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())


def test_a_gguf_holds_quantized_linears_when_a_tensor_is_of_a_kept_type(tmp_path):
    """``--weights auto`` keeps what `quant.KEPT_TYPES` names: a file with Q4_0/Q4_1/Q8_0 tensors holds
    quantized linears, one of float tensors and Q2_K/Q3_K (dequantized at load) does not, nor does an HF directory."""
    assert holds_quantized_linears(embedded_model_path())
    mixed, plain = tmp_path / "mixed.gguf", tmp_path / "plain.gguf"
    _write_tiny_gguf(mixed)
    _write_tiny_gguf(plain, types={"token_embd.weight": Q.F16, "blk.0.attn_q.weight": Q.F16, "blk.0.attn_k.weight": Q.F32,
                                   "blk.0.ffn_gate.weight": Q.BF16, "blk.0.ffn_up.weight": Q.Q2_K, "blk.0.ffn_down.weight": Q.Q3_K},
                     ffn=256, hidden=256)
    assert holds_quantized_linears(mixed) and not holds_quantized_linears(plain)
    assert not holds_quantized_linears(tmp_path)
    with pytest.raises(ModelLoadError, match="missing.gguf"):
        holds_quantized_linears(tmp_path / "missing.gguf")

def test_a_block_tensor_whose_rows_are_not_whole_blocks_is_refused(tmp_path):
    """A Q6_K tensor's dims rewritten from 256 x 64 to 128 x 128 (the same bytes): rows of 128 values
    are half a super-block, refused by name (gguf-py's writer itself refuses to write one)."""
    path = tmp_path / "bad.gguf"
    write_gguf(path, {"blk.0.ffn_down.weight": Q.Q6_K}, ffn=256)
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_down.weight"
    dims = data.index(name) + len(name) + 4  # the name, then n_dims (uint32), then the dims (uint64, ne0 first)
    assert struct.unpack_from("<2Q", data, dims) == (256, 64)
    struct.pack_into("<2Q", data, dims, 128, 128)
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"bad\.gguf: tensor 'blk\.0\.ffn_down\.weight' of type Q6_K: rows of 128 values are not whole blocks of 256"):
        load_weights(path, torch.float32)


@pytest.mark.parametrize("keep_bytes", [10, 4000, 50_000_000])
def test_truncated_gguf_raises_model_load_error_naming_file(tmp_path, keep_bytes):
    """A GGUF cut inside the fixed header, inside the metadata, or inside the tensor data is rejected."""
    path = tmp_path / "cut.gguf"
    with open(embedded_model_path(), "rb") as src:
        path.write_bytes(src.read(keep_bytes))
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_weights(path, torch.float32)


def test_bad_magic_raises_model_load_error(tmp_path):
    """A file that is not GGUF at all is rejected with the file named."""
    path = tmp_path / "notgguf.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelLoadError, match=r"notgguf\.gguf.*bad magic"):
        load_weights(path, torch.float32)


def test_unsupported_gguf_architecture_raises(tmp_path):
    """A GGUF for an architecture other than llama/qwen2 is rejected by name."""
    path = tmp_path / "gpt2.gguf"
    _write_tiny_gguf(path, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"gpt2\.gguf: unsupported architecture 'gpt2'"):
        load_weights(path, torch.float32)


def _tiny_hf_dir(tmp_path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_hf_directory_errors_name_the_file(tmp_path):
    """HF directories: an unsupported model_type, a missing tensor and a corrupt safetensors file
    each raise ModelLoadError naming the offending file and the problem."""
    directory = _tiny_hf_dir(tmp_path)
    config_file = directory / "config.json"
    raw = json.loads(config_file.read_text())

    config_file.write_text(json.dumps(raw | {"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match=r"config\.json: unsupported model_type 'gpt2'"):
        load_weights(directory, torch.float32)

    config_file.write_text(json.dumps(raw | {"num_hidden_layers": 2}))  # layer 1's tensors do not exist
    with pytest.raises(ModelLoadError, match=r"tensor 'model\.layers\.1\.input_layernorm\.weight' is missing"):
        load_weights(directory, torch.float32)

    config_file.write_text(json.dumps(raw))
    shard = directory / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"):
        load_weights(directory, torch.float32)

    shutil.rmtree(directory)
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        load_weights(directory, torch.float32)


def test_a_base_models_checkpoint_loads_as_its_causal_lm(tmp_path):
    """An embedding model saved as the base model (sentence-transformers' Qwen3-Embedding: Qwen3Model,
    tensors without "model.") loads with the same weights as the causal LM it came from."""
    from transformers import AutoModel

    from tests.tiny_checkpoint import write_tiny_checkpoint

    causal = write_tiny_checkpoint(tmp_path / "causal", family="qwen3")
    base = tmp_path / "base"
    AutoModel.from_pretrained(causal).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(causal / name, base / name)
    _, expected = load_weights(causal, torch.float32)
    _, loaded = load_weights(base, torch.float32)
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[name], expected[name]) for name in expected)
