"""Load a checkpoint of a registered family (GGUF file or Hugging Face directory) into host tensors.

Tensors come back under Hugging Face names (``model.layers.{i}.self_attn.q_proj.weight``, ...) in
HF layout, whatever the source format, so the model has one naming scheme to consume.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import mmap
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors import safe_open

from stageserve.device.model.config import ModelConfig, ModelLoadError, config_from_gguf, config_from_hf
from stageserve.device.model.family import family_named
from stageserve.device.kernels.quant import KEPT_TYPES, QuantizedWeight, from_gguf_bytes
from stageserve.gguf_header import GGUFHeaderError, GGUFTensor, read_gguf_header

log = logging.getLogger(__name__)

__all__ = ["ModelLoadError", "expected_shapes", "load_config", "load_weights"]

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # Phi-3's fused projection
    "attn_post_norm.weight": "post_attention_layernorm.weight",  # Gemma's sandwich norms (with ffn_norm below)
    "ffn_post_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",  # a mixture of experts' router, and its experts stacked [experts, out, in]
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    # DeepSeek's (llama.cpp's deepseek2): latent attention, shared experts, the router's correction bias
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.k_b_proj.weight",  # kv_b_proj split (see _joined_kv_b)
    "attn_v_b.weight": "self_attn.v_b_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
# With sandwich norms llama.cpp's ffn_norm is the MLP's input norm, Gemma's pre_feedforward_layernorm
# (its post_attention_layernorm, on the attention output, is attn_post_norm).
_GGUF_SANDWICH_LAYER_NAMES = _GGUF_LAYER_NAMES | {"ffn_norm.weight": "pre_feedforward_layernorm.weight"}
# llama.cpp's LongRoPE factors (Phi-3), into ModelConfig.rope_scaling.
_GGUF_ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}


def load_weights(path: Path, dtype: torch.dtype, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedWeight]]:
    """Read a model's config and weights as CPU tensors of ``dtype`` under HF names (DeepSeek's router
    correction bias in float32).

    ``path`` is a ``.gguf`` file (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/K-quants/IQ formats, dequantized
    as ``gguf.quants.dequantize`` does) or an HF directory (``config.json`` plus one or more
    ``*.safetensors``). Every tensor of ``expected_shapes(config)`` is present with that shape;
    ``model.layers.{i}.self_attn.o_proj.bias`` may also be present. ``keep_quantized``: a GGUF's 2-D
    tensors of `quant.KEPT_TYPES` (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K) come back as they are stored
    (`QuantizedWeight`, Q/K rows already un-permuted) instead of dequantized; other block types (Q2_K,
    Q3_K, IQ formats) are dequantized, and logged.

    Raises:
        ModelLoadError: unsupported architecture, missing or misshapen tensor, or a corrupt or
            truncated file; the message names the file.
    """
    path = Path(path)
    if path.is_dir():
        config, weights = _load_hf_dir(path, dtype)
    elif path.is_file():
        config, weights = _load_gguf(path, dtype, keep_quantized)
    else:
        raise ModelLoadError(f"{path}: no such file or directory")
    _check_shapes(config, weights, path)
    return config, weights


def load_config(path: Path) -> ModelConfig:
    """Read only a model's config (GGUF header or ``config.json``), no tensor data (the sim backend).

    Raises:
        ModelLoadError: unsupported architecture, or an unreadable file; the message names the file.
    """
    path = Path(path)
    if path.is_dir():
        generation = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
        eos = generation.get("eos_token_id")
        return config_from_hf(_read_json(path / "config.json"), [] if eos is None else [eos] if isinstance(eos, int) else list(eos), path / "config.json")
    return _read_gguf_config(path)[0]


def holds_quantized_linears(path: Path) -> bool:
    """Whether ``path`` is a GGUF file with a tensor of a type the quantized kernels take as stored
    (`quant.KEPT_TYPES`), which ``--weights auto`` keeps quantized; an HF directory holds none. Only
    the header is read.

    Raises:
        ModelLoadError: an unreadable or corrupt file; the message names it.
    """
    path = Path(path)
    if path.is_dir():
        return False
    return any(t.qtype in KEPT_TYPES for t in _read_gguf_config(path)[1])


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape ``[out_features, in_features]`` (or ``[n]``) that a model needs."""
    c = config
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (c.hidden_size,), p + "post_attention_layernorm.weight": (c.hidden_size,)}
        shapes |= _mla_shapes(p + "self_attn.", c) if c.kv_lora_rank else {
            p + "self_attn.q_proj.weight": (c.q_size, c.hidden_size),
            p + "self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.v_proj.weight": (c.kv_size, c.hidden_size),
            p + "self_attn.o_proj.weight": (c.hidden_size, c.q_size),
        }
        if c.moe_layers[i]:  # the router, then each expert's MLP, DeepSeek's correction bias and shared experts
            shapes[p + "mlp.gate.weight"] = (c.num_experts, c.hidden_size)
            for j in range(c.num_experts):
                shapes |= _mlp_shapes(f"{p}mlp.experts.{j}.", c.hidden_size, c.moe_intermediate_size)
            if c.router_scoring == "sigmoid":
                shapes[p + "mlp.gate.e_score_correction_bias"] = (c.num_experts,)
            if c.shared_experts:
                shapes |= _mlp_shapes(p + "mlp.shared_experts.", c.hidden_size, c.moe_intermediate_size * c.shared_experts)
        else:
            shapes |= _mlp_shapes(p + "mlp.", c.hidden_size, c.intermediate_size)
        if c.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (c.q_size,), p + "self_attn.k_proj.bias": (c.kv_size,),
                       p + "self_attn.v_proj.bias": (c.kv_size,)}
        if c.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)}
        if c.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (c.hidden_size,), p + "post_feedforward_layernorm.weight": (c.hidden_size,)}
    return shapes


def _mla_shapes(p: str, c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A latent attention's tensors (transformers' ``DeepseekV3Attention``; ``mla.py``)."""
    shapes = {p + "kv_a_proj_with_mqa.weight": (c.kv_lora_rank + c.head_dim, c.hidden_size), p + "kv_a_layernorm.weight": (c.kv_lora_rank,),
              p + "kv_b_proj.weight": (c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
              p + "o_proj.weight": (c.hidden_size, c.num_heads * c.v_head_dim)}
    if c.q_lora_rank is None:
        return shapes | {p + "q_proj.weight": (c.q_size, c.hidden_size)}
    return shapes | {p + "q_a_proj.weight": (c.q_lora_rank, c.hidden_size), p + "q_a_layernorm.weight": (c.q_lora_rank,),
                     p + "q_b_proj.weight": (c.q_size, c.q_lora_rank)}


def _mlp_shapes(p: str, hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    return {p + "gate_proj.weight": (intermediate, hidden), p + "up_proj.weight": (intermediate, hidden),
            p + "down_proj.weight": (hidden, intermediate)}


def _check_shapes(config: ModelConfig, weights: dict[str, torch.Tensor], path: Path) -> None:
    for name, shape in expected_shapes(config).items():
        if name not in weights:
            raise ModelLoadError(f"{path}: tensor {name!r} is missing")
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(f"{path}: tensor {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")


# Phi-3's fused projections (transformers' ``Phi3Attention.qkv_proj``, ``Phi3MLP.gate_up_proj``: gate
# rows first; GGUF ``attn_qkv``, ``ffn_up``), split at load into the names every other family uses.
_FUSED_HF_NAMES = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}


# Experts stacked in one tensor, split at load into each expert's own (the names transformers saves
# Qwen3-MoE under): GGUF's ``ffn_*_exps`` [experts, out, in]; transformers 5's fused parameters
# (``Qwen3MoeExperts``, ``MixtralExperts``: ``gate_up_proj`` [experts, 2 * intermediate, hidden], gate rows first).
_EXPERT_STACKS = {
    "mlp.experts.gate_proj.weight": ("gate_proj.weight",), "mlp.experts.up_proj.weight": ("up_proj.weight",),
    "mlp.experts.down_proj.weight": ("down_proj.weight",),
    "mlp.experts.gate_up_proj": ("gate_proj.weight", "up_proj.weight"), "mlp.experts.down_proj": ("down_proj.weight",),
}


def _split_fused(name: str, tensor: torch.Tensor | QuantizedWeight, config: ModelConfig, path: Path) -> list[tuple[str, torch.Tensor | QuantizedWeight]]:
    """``[(name, tensor)]``, or for a fused projection (``_FUSED_HF_NAMES``) its parts by rows under
    their own names, for a stack of experts (``_EXPERT_STACKS``; a quantized one as the 2-D rows of
    every expert in turn) each expert's parts (a `QuantizedWeight` splits by its rows of blocks).
    Raises ``ModelLoadError`` naming ``path`` for a fused tensor whose rows do not add up."""
    stack = next((s for s in _EXPERT_STACKS if name.endswith("." + s)), None)
    suffix = stack or next((s for s in _FUSED_HF_NAMES if name.endswith("." + s)), None)
    if suffix is None:
        return [(name, tensor)]
    prefix = name.removesuffix("." + suffix)
    if stack is not None:
        names = tuple(f"mlp.experts.{j}.{part}" for j in range(config.num_experts) for part in _EXPERT_STACKS[stack])
        sizes = (config.hidden_size if "down" in stack else config.moe_intermediate_size,) * len(names)
        tensor = tensor if isinstance(tensor, QuantizedWeight) else tensor.reshape(-1, tensor.shape[-1])
    else:
        names = _FUSED_HF_NAMES[suffix]
        sizes = (config.q_size, config.kv_size, config.kv_size) if suffix.startswith("self_attn.") else (config.intermediate_size,) * 2
    rows = tensor.shape[0]
    if rows != sum(sizes):
        raise ModelLoadError(f"{path}: tensor {name!r} has {rows} rows, expected {sum(sizes)}")
    blocks = tensor.blocks if isinstance(tensor, QuantizedWeight) else tensor
    parts = [QuantizedWeight(tensor.qtype, p) if isinstance(tensor, QuantizedWeight) else p for p in blocks.split(sizes)]
    return [(f"{prefix}.{part_name}", part) for part_name, part in zip(names, parts)]


# ---- GGUF -------------------------------------------------------------------------------------
def _read_gguf_config(path: Path) -> tuple[ModelConfig, list[GGUFTensor]]:
    """The config and tensor infos of the GGUF file at ``path``, from its header alone. Raises ModelLoadError naming ``path``."""
    if not path.is_file() or path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: no such file, or empty")
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        return _gguf_config(buffer, path)


def _gguf_config(buffer: mmap.mmap, path: Path) -> tuple[ModelConfig, list[GGUFTensor]]:
    """The config and tensor infos of the GGUF file in ``buffer``. Raises ModelLoadError naming ``path``."""
    try:
        fields, infos = read_gguf_header(buffer, path)
        return config_from_gguf(fields, {t.name: t.shape for t in infos}, path), infos
    except ModelLoadError:
        raise
    except GGUFHeaderError as exc:
        raise ModelLoadError(str(exc)) from exc
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF header ({type(exc).__name__}: {exc})") from exc


def _load_gguf(path: Path, dtype: torch.dtype, keep_quantized: bool) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedWeight]]:
    if path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: empty file")
    with open(path, "rb") as file:
        # Copy-on-write so torch.frombuffer gets a writable buffer; the mapping is released once
        # the last tensor viewing it is gone (every returned tensor is a copy).
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    config, infos = _gguf_config(buffer, path)
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    dequantized_blocks: set[str] = set()
    qk_permuted = family_named(config.architecture).gguf_qk_permuted
    for info in infos:
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
        kept = keep_quantized and info.qtype in KEPT_TYPES and len(info.shape) in (2, 3)  # 3-D: a stack of experts
        tensor = from_gguf_bytes(raw, info.qtype, (math.prod(info.shape[:-1]), info.shape[-1])) if kept else _dequantize(raw, info, path)
        if info.name == "rope_freqs.weight":
            config = dataclasses.replace(config, rope_freq_factors=tuple(tensor.tolist()))
            continue
        if info.name in _GGUF_ROPE_FACTORS and config.rope_scaling:
            config = dataclasses.replace(config, rope_scaling=config.rope_scaling | {_GGUF_ROPE_FACTORS[info.name]: tensor.tolist()})
            continue
        hf_name = _hf_name(info.name, config.sandwich_norms)
        if hf_name is not None and hf_name.endswith("mlp.up_proj.weight") and tensor.shape[0] == 2 * config.intermediate_size:
            hf_name = hf_name.replace("up_proj", "gate_up_proj")  # Phi-3's fused gate and up rows in one ffn_up
        if hf_name is None:
            raise ModelLoadError(f"{path}: unexpected tensor {info.name!r} for architecture {config.architecture!r}")
        if keep_quantized and not kept and info.qtype not in _FLOAT_TYPES:
            dequantized_blocks.add(info.qtype.name)
        if qk_permuted and (".attn_q." in info.name or ".attn_k." in info.name):
            heads = config.num_heads if ".attn_q." in info.name else config.num_kv_heads
            tensor = QuantizedWeight(tensor.qtype, _unpermute_rope_rows(tensor.blocks, heads)) if kept else _unpermute_rope_rows(tensor, heads)
        if hf_name.endswith(("k_b_proj.weight", "v_b_proj.weight")) and kept:
            tensor = tensor.dequantize().view(info.shape)  # joined into kv_b_proj: the decoder keeps it dense
        for name, part in _split_fused(hf_name, tensor, config, path):
            weights[name] = part if kept and isinstance(part, QuantizedWeight) else part.to(_load_dtype(name, dtype), copy=True)
    _joined_kv_b(weights, config)
    if dequantized_blocks:
        log.info("%s: tensors of type %s dequantized to %s at load: no weight-only kernel here takes that block format",
                 path.name, ", ".join(sorted(dequantized_blocks)), str(dtype).removeprefix("torch."))
    return config, weights


def _load_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """``dtype``, but float32 for DeepSeek-V3's router correction bias: it decides between experts
    whose scores differ by less than a bfloat16 step (transformers keeps it float32 too)."""
    return torch.float32 if name.endswith("e_score_correction_bias") else dtype


def _joined_kv_b(weights: dict[str, torch.Tensor | QuantizedWeight], config: ModelConfig) -> None:
    """llama.cpp's converter (``DeepseekV2Model.modify_tensors``) splits ``kv_b_proj`` [H * (nope + v), r]
    into ``attn_k_b`` [H, r, nope] (transposed) and ``attn_v_b`` [H, v, r]; join them back, in place."""
    for name in [n for n in weights if n.endswith("self_attn.k_b_proj.weight")]:
        k_b, v_b = weights.pop(name), weights.pop(name.replace("k_b_proj", "v_b_proj"))
        kv_b = torch.cat((k_b.view(config.num_heads, config.kv_lora_rank, -1).transpose(1, 2), v_b.view(config.num_heads, -1, config.kv_lora_rank)), 1)
        weights[name.replace("k_b_proj", "kv_b_proj")] = kv_b.reshape(-1, config.kv_lora_rank)


_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def _dequantize(raw: torch.Tensor, info: GGUFTensor, path: Path) -> torch.Tensor:
    """GGUF tensor bytes (uint8 [nbytes]) -> float tensor of ``info.shape``.

    Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K decode vectorised in torch (multi-threaded,
    ``QuantizedWeight.dequantize``, bit for bit as gguf); other block types go through
    ``gguf.quants.dequantize`` (numpy).
    """
    t, shape = gguf.GGMLQuantizationType, info.shape
    if info.qtype in _FLOAT_TYPES:
        return raw.view({t.F32: torch.float32, t.F16: torch.float16, t.BF16: torch.bfloat16}[info.qtype]).view(shape)
    if info.qtype in KEPT_TYPES:
        return from_gguf_bytes(raw, info.qtype, (math.prod(shape[:-1]), shape[-1])).dequantize().view(shape)
    try:
        return torch.from_numpy(dequantize(raw.numpy(), info.qtype).astype(np.float32, copy=False)).view(shape)
    except (ValueError, NotImplementedError) as exc:
        raise ModelLoadError(f"{path}: tensor {info.name!r} of type {info.qtype.name} cannot be dequantized: {exc}") from exc


def _hf_name(gguf_name: str, sandwich_norms: bool) -> str | None:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    layer_names = _GGUF_SANDWICH_LAYER_NAMES if sandwich_norms else _GGUF_LAYER_NAMES
    blk, _, rest = gguf_name.partition(".")
    index, _, suffix = rest.partition(".")
    if blk != "blk" or not index.isdigit() or suffix not in layer_names:
        return None
    return f"model.layers.{index}.{layer_names[suffix]}"


def _unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation so HF's rotate-half RoPE applies.

    llama.cpp's ``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders each head's rows from
    halves ``[x0..x(d/2-1), x(d/2)..]`` to interleaved pairs for GGML's adjacent-pair RoPE; this is
    the inverse (as in transformers' ``LlamaTensorProcessor._reverse_permute_weights``).
    Works for weights ``[heads*d, in]`` and biases ``[heads*d]``.
    """
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# ---- Hugging Face directory -----------------------------------------------------------------


# A base model's checkpoint (a sentence-transformers embedding model such as Qwen3-Embedding:
# Qwen3Model) names the decoder's tensors without "model.".
_BASE_MODEL_PREFIXES = (("embed_tokens.", "model.embed_tokens."), ("layers.", "model.layers."), ("norm.", "model.norm."))


def _load_hf_dir(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config_file = path / "config.json"
    raw = _read_json(config_file)
    generation = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    eos = generation.get("eos_token_id")
    eos_extra = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    config = config_from_hf(raw, eos_extra, config_file)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    wanted = expected_shapes(config).keys() | {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(config.num_layers)}
    return config, _read_hf_tensors(files, config, dtype, wanted, lambda name: name)


def load_mtp_weights(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A Hugging Face directory's first multi-token-prediction module (DeepSeek-V3 technical report
    §2.2; ``num_nextn_predict_layers``, stored as ``model.layers.{num_hidden_layers}.*``) as a
    one-layer model: its config (the target's, one layer, dense or mixture of experts as layer
    ``num_hidden_layers`` would be) and its tensors under the names a one-layer `DecoderModel` reads
    (the block as ``model.layers.0.*``, ``shared_head.norm`` as ``model.norm``, ``shared_head.head``
    as ``lm_head``, the module's ``embed_tokens`` or else the target's), plus ``mtp.enorm.weight``,
    ``mtp.hnorm.weight`` ``[hidden]`` and ``mtp.eh_proj.weight`` ``[hidden, 2 * hidden]``, all of
    ``dtype`` on the CPU.

    Raises:
        ModelLoadError: not a Hugging Face directory, no such layers (the message says what to use
            instead), or a missing or misshapen tensor.
    """
    path = Path(path)
    instead = "choose --speculative-method ngram or draft"
    if not path.is_dir():
        raise ModelLoadError(f"{path}: --speculative-method mtp reads the multi-token-prediction layers of a Hugging Face directory; "
                             f"a GGUF file does not carry them here; {instead}")
    raw = _read_json(path / "config.json")
    if not int(raw.get("num_nextn_predict_layers") or 0):
        raise ModelLoadError(f"{path}: --speculative-method mtp needs multi-token-prediction layers, and config.json's "
                             f"num_nextn_predict_layers is {raw.get('num_nextn_predict_layers', 'absent')}; {instead}")
    target = load_config(path)
    index = target.num_layers
    # DeepSeek's rule for the layer at ``index`` (its MTP layers are mixtures of experts past the dense ones).
    dense = index < int(raw.get("first_k_dense_replace") or 0)
    config = dataclasses.replace(target, num_layers=1, tie_word_embeddings=False, dense_mlp_layers=(0,) if dense else ())
    own = f"model.layers.{index}."
    names = {own + "shared_head.norm.weight": "model.norm.weight", own + "shared_head.head.weight": "lm_head.weight",
             own + "embed_tokens.weight": "model.embed_tokens.weight", **{own + n: "mtp." + n for n in _MTP_TENSORS}}

    def rename(name: str) -> str:
        if name in names:
            return names[name]
        if name.startswith(own):
            return "model.layers.0." + name.removeprefix(own)
        # The target's layers and final norm are not the module's; its embedding and head are shared unless the module has its own.
        return "" if name.startswith("model.layers.") or name == "model.norm.weight" else name

    shapes = expected_shapes(config) | {"mtp.enorm.weight": (config.hidden_size,), "mtp.hnorm.weight": (config.hidden_size,),
                                        "mtp.eh_proj.weight": (config.hidden_size, 2 * config.hidden_size)}
    files = sorted(path.glob("*.safetensors"))
    module = _read_hf_tensors(files, config, dtype, shapes.keys(), rename, prefer=("model.embed_tokens.weight", "lm_head.weight"))
    if not any(name.startswith("mtp.") for name in module):  # transformers writes num_nextn_predict_layers and drops the layers
        raise ModelLoadError(f"{path}: --speculative-method mtp needs multi-token-prediction layers, and the checkpoint has none "
                             f"(no model.layers.{index}.* tensors, though config.json's num_nextn_predict_layers is "
                             f"{raw['num_nextn_predict_layers']}); {instead}")
    if "lm_head.weight" not in module and "model.embed_tokens.weight" in module:  # no head of its own, the target's tied one
        module["lm_head.weight"] = module["model.embed_tokens.weight"]
    for name, shape in shapes.items():
        if name not in module:
            raise ModelLoadError(f"{path}: missing tensor {name!r} of the multi-token-prediction layer {index}")
        if tuple(module[name].shape) != shape:
            raise ModelLoadError(f"{path}: the multi-token-prediction layer's {name!r} has shape {tuple(module[name].shape)}, expected {shape}")
    return config, module


_MTP_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight")  # what a multi-token-prediction layer adds to a decoder block


def _read_hf_tensors(files: list[Path], config: ModelConfig, dtype: torch.dtype, wanted, rename,
                     prefer: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """The tensors of ``files`` (safetensors) whose name, as the family and then ``rename`` write it,
    is in ``wanted`` (fused and stacked ones split), as CPU tensors of ``dtype``; a name in
    ``prefer`` that ``rename`` produced from another name keeps that one over the name as stored."""
    family = family_named(config.architecture)
    weights: dict[str, torch.Tensor] = {}
    renamed: set[str] = set()
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for stored in handle.keys():
                    plain = family.hf_weight_names(_renamed(stored, family.hf_weight_prefixes + _BASE_MODEL_PREFIXES))
                    name = rename(plain)
                    if name in prefer:
                        if name != plain:
                            renamed.add(name)
                        elif name in renamed:
                            continue
                    if name in wanted or name.endswith(tuple(_FUSED_HF_NAMES) + tuple(_EXPERT_STACKS)):
                        for part_name, part in _split_fused(name, handle.get_tensor(stored), config, file):
                            if family.hf_norm_offset and part_name.endswith("norm.weight"):  # (1 + w) norms: the multiplier, in float32
                                part = part.float() + family.hf_norm_offset
                            weights[part_name] = part.to(_load_dtype(part_name, dtype))
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises SafetensorError / OSError on bad headers or sizes
            raise ModelLoadError(f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc
    return weights


def _renamed(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    """``name`` with the first of ``prefixes``' ``(prefix, replacement)`` it starts with replaced (a family's ``hf_weight_prefixes``)."""
    for prefix, replacement in prefixes:
        if name.startswith(prefix):
            return replacement + name.removeprefix(prefix)
    return name


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{file}: missing") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{file}: cannot be parsed as JSON: {exc}") from exc
