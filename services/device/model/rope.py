"""Rotary position embeddings (Su et al. 2021, "RoFormer"), with the Llama 3 and YaRN frequency
scalings as transformers computes them, in the rotate-half pairing of the Hugging Face models."""

from __future__ import annotations

import math

import torch

from stageserve.device.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float, int]:
    """Inverse frequencies ``[head_dim // 2]`` float32, the cos/sin scale, and the table length.

    Base RoPE: ``theta ** (-2i / d)`` (Su et al. 2021). Scaling variants follow transformers'
    ``modeling_rope_utils``: ``linear`` (divide by ``factor``, kaiokendev), ``llama3`` (Meta's
    smooth low/high-frequency blend, ``_compute_llama3_parameters``), ``yarn`` (Peng et al. 2023,
    ``_compute_yarn_parameters``, incl. its attention factor). ``dynamic`` NTK is applied as one
    static table for ``max_position_embeddings * factor`` positions with the NTK-enlarged base,
    as vLLM does, because a paged cache cannot re-rotate keys already stored when a sequence grows.
    llama.cpp's ``rope_freqs`` (``config.rope_freq_factors``) divide the frequencies.
    """
    dim, base, length = config.head_dim, config.rope_theta, config.max_position_embeddings
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


def _yarn_inv_freq(pos_freqs: torch.Tensor, s: dict, config: ModelConfig) -> tuple[torch.Tensor, float]:
    dim, base = config.head_dim, config.rope_theta
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
    """
    inv_freq, attention_factor, length = rope_inv_freq(config)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # [P, D/2]
    cos, sin = angles.cos() * attention_factor, angles.sin() * attention_factor
    return torch.cat((cos, cos), -1).to(device, dtype), torch.cat((-sin, sin), -1).to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, D]`` by per-token ``cos``/``signed_sin`` ``[T, 1, D]``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)
