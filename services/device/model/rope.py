"""Rotary position embeddings (Su et al. 2021, "RoFormer"), with the Llama 3, YaRN and LongRoPE
frequency scalings as transformers computes them, in the rotate-half pairing of the Hugging Face
models, partial rotary (only the first ``rotary_dim`` values of a head rotate: Phi-3), and a second base for
the windowed layers (Gemma 3's ``rope_local_base_freq``)."""

from __future__ import annotations

import dataclasses
import math

import torch

from stageserve.device.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float, int]:
    """Inverse frequencies ``[(rotary_dim or head_dim) // 2]`` float32, the cos/sin scale, and the table length.

    Base RoPE: ``theta ** (-2i / d)`` (Su et al. 2021). Scaling variants follow transformers'
    ``modeling_rope_utils``: ``linear`` (divide by ``factor``, kaiokendev), ``llama3`` (Meta's
    smooth low/high-frequency blend, ``_compute_llama3_parameters``), ``yarn`` (Peng et al. 2023,
    ``_compute_yarn_parameters``, incl. its attention factor), ``longrope`` (Phi-3's short factors,
    ``_compute_longrope_parameters``, incl. its attention factor; the long ones: ``rope_tables``).
    ``dynamic`` NTK is applied as one static table for ``max_position_embeddings * factor``
    positions with the NTK-enlarged base, as vLLM does, because a paged cache cannot re-rotate keys
    already stored when a sequence grows. llama.cpp's ``rope_freqs`` (``config.rope_freq_factors``)
    divide the frequencies. With ``config.rotary_dim`` they are those of a ``rotary_dim``-wide head
    (``rotary_dim // 2`` values).
    """
    dim, base, length = config.rotary_dim or config.head_dim, config.rope_theta, config.max_position_embeddings
    scaling = config.rope_scaling or {"rope_type": "default"}
    kind, attention_factor = scaling["rope_type"], 1.0
    if kind == "dynamic":
        factor = scaling["factor"]
        length = int(length * factor)
        base = base * (factor * factor - (factor - 1)) ** (dim / (dim - 2))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (base**exponent)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(base**exponent, scaling, config)
    elif kind == "longrope":
        inv_freq, attention_factor = inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float32), _longrope_attention_factor(scaling, config)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq, attention_factor, length


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high, old_len = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _longrope_attention_factor(s: dict, config: ModelConfig) -> float:
    """LongRoPE's cos/sin scale (transformers' ``_compute_longrope_parameters``): ``attention_factor``, else
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` for a ``factor`` (default
    ``max_position_embeddings / original_max_position_embeddings``) above 1."""
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or config.max_position_embeddings / old_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def _yarn_inv_freq(pos_freqs: torch.Tensor, s: dict, config: ModelConfig) -> tuple[torch.Tensor, float]:
    dim, base = config.rotary_dim or config.head_dim, config.rope_theta
    old_len = s.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = s.get("factor") or config.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_tables(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and signed ``sin`` tables ``[positions, head_dim]`` of ``dtype``.

    Angles are computed in float32 (as transformers does) and cast. The sine table's first half is
    negated so ``rotate_half(x) * sin == x.roll(head_dim // 2, -1) * signed_sin``: one roll instead
    of a split, a negation and a concatenation per layer.

    ``longrope``: positions from ``original_max_position_embeddings`` on take the long factors.
    transformers re-encodes a whole sequence with them once it grows past that length
    (``Phi3ForCausalLM.prepare_inputs_for_generation`` drops its cache); a paged cache keeps the keys
    it stored, so a sequence crossing that length keeps its earlier keys' short-factor rotation
    (as vLLM's ``Phi3LongRoPEScaledRotaryEmbedding`` does per step), and matches transformers exactly
    only while it stays within it.

    With ``config.rotary_dim`` the tables serve a head whose rows ``rotary_row_order`` rearranged:
    its rotating values lie at ``[0, r/2)`` and ``[D/2, D/2 + r/2)``, the others get cos 1 and sin 0.
    """
    inv_freq, attention_factor, length = rope_inv_freq(config)
    positions = torch.arange(length, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # [P, r/2]
    if config.rope_scaling and config.rope_scaling["rope_type"] == "longrope":
        old_len = config.rope_scaling["original_max_position_embeddings"]
        long_inv_freq = inv_freq * torch.tensor(config.rope_scaling["short_factor"]) / torch.tensor(config.rope_scaling["long_factor"])
        angles[old_len:] = torch.outer(positions[old_len:], long_inv_freq)
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    pass_through = config.head_dim // 2 - inv_freq.shape[0]
    cos = torch.cat((cos, torch.ones(length, pass_through)), -1)  # [P, D/2]
    sin = torch.cat((sin, torch.zeros(length, pass_through)), -1)
    return torch.cat((cos, cos), -1).to(device, dtype), torch.cat((-sin, sin), -1).to(device, dtype)


def layer_rope_tables(config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], tuple[int, ...]]:
    """The distinct ``rope_tables`` of the model's layers and each layer's index into them.

    One table for every layer, except with ``config.local_rope_theta`` (Gemma 3): the local layers
    (those not in ``full_attention_layers``) rotate by a second table of that base without ``rope_scaling`` (transformers'
    ``Gemma3RotaryEmbedding`` for ``sliding_attention``; llama.cpp's ``rope_freq_base_train_swa``).
    """
    tables = [rope_tables(config, dtype, device)]
    if config.local_rope_theta is None:
        return tables, (0,) * config.num_layers
    local = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None, rope_freq_factors=None)
    tables.append(rope_tables(local, dtype, device))
    return tables, tuple(0 if i in config.full_attention_layers else 1 for i in range(config.num_layers))


def rotary_row_order(config: ModelConfig) -> torch.Tensor | None:
    """With ``config.rotary_dim`` r of head size D: the order ``[D]`` int64 to take each query and key
    head's values (projection rows) in, so the rotate-half pairs ``(i, i + r/2)``, ``i < r/2``, of
    transformers' partial rotary (``apply_rotary_pos_emb`` in ``modeling_phi3.py``) become the whole
    head's pairs ``(i, i + D/2)``, the rest not rotated (``rope_tables``): the same dot products, by
    one permutation of queries and keys alike, so the RoPE ops and the KV pool stay as they are.
    ``None`` without partial rotary.
    """
    r, d = config.rotary_dim, config.head_dim
    if r is None:
        return None
    rest = (d - r) // 2
    return torch.cat([torch.arange(r // 2), torch.arange(r, r + rest), torch.arange(r // 2, r), torch.arange(r + rest, d)])


def interleaved_row_order(dim: int) -> torch.Tensor:
    """The order ``[dim]`` int64 to take a rotated part's values (projection rows) in when a checkpoint
    pairs them as ``(0, 1), (2, 3), ...`` (DeepSeek's ``rope_interleave``, transformers'
    ``apply_rotary_pos_emb_interleave``; llama.cpp's NORM RoPE): evens, then odds, so rotate-half's
    pairs ``(i, i + dim/2)`` are the checkpoint's ``(2i, 2i + 1)`` and give its outputs in the order
    transformers writes them (queries and keys alike, so every dot product is the same)."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` by per-token ``cos``/``signed_sin`` ``[T, 1, D]``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)
