"""The embedded model requantized to llama.cpp's Q4_K_M and Q6_K mixes, for the suite and the benchmarks.

gguf-py quantizes no K-quant, so Q4_K and Q6_K blocks are written here by a plain round-to-nearest
(ggml-quants.c's layouts, ``block_q4_K`` and ``block_q6_K``, without llama.cpp's search for the best
scales: a coarser quantizer, the same format; `tests/unit/device/test_kquant_writer.py` reads them
back with gguf's dequantizer). The embedded model's K (576) is not a multiple of 256 except
down_proj's (1536), so as ``llama-quantize`` does for such tensors the mixes fall back to Q5_0 (for
Q4_K) and Q8_0 (for Q6_K) elsewhere; Q4_K_M's "more bits" layers (the first and last eighth, every
third) get Q6_K down_proj and Q8_0 v_proj (llama.cpp's ``llama_tensor_get_type``).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf.quants import quantize

from stageserve.device.kernels.quant import QuantizedWeight
from stageserve.device.model.config import ModelConfig
from stageserve.device.model.weights import load_weights
from stageserve.model_files import embedded_model_path

Q = gguf.GGMLQuantizationType
MIXES = ("stored", "q4_k_m", "q6_k")  # the embedded file as it is stored (Q4_1, Q8_0 head), and requantized


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """float32 ``[n]`` -> their float16 bytes ``[n, 2]``."""
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _divide(x: np.ndarray, by: np.ndarray) -> np.ndarray:
    return np.where(by != 0, x / np.where(by != 0, by, 1), 0)


def q6_k_blocks(w: np.ndarray) -> np.ndarray:
    """``w`` float32 ``[rows, K]`` (K a multiple of 256) as Q6_K blocks uint8 ``[rows * K / 256, 210]``:
    per 16 values a scale ``max |x| / 31`` rounded to int8 steps of ``d = max scale / 127``, ``q - 32 = round(x / (d sc))``."""
    x = w.reshape(-1, 16, 16)
    d = (np.abs(x).max(-1).max(-1) / 31 / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_divide(np.abs(x).max(-1) / 31, d[:, None])), 0, 127).astype(np.int8)
    q = (np.clip(np.round(_divide(x, (d[:, None] * sc)[..., None])), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # half, s, l
    ql = np.zeros((len(q), 2, 2, 32), np.uint8)  # value 128 h + 32 s + l: nibble s // 2 of ql[64 h + 32 (s % 2) + l]
    qh = np.zeros((len(q), 2, 32), np.uint8)  # and bits 2 s, 2 s + 1 of qh[32 h + l]
    for s in range(4):
        ql[:, :, s % 2] |= (q[:, :, s] & 15) << (4 * (s // 2))
        qh |= (q[:, :, s] >> 4) << (2 * s)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], 1)


def q4_k_blocks(w: np.ndarray) -> np.ndarray:
    """``w`` float32 ``[rows, K]`` (K a multiple of 256) as Q4_K blocks uint8 ``[rows * K / 256, 144]``:
    per 32 values ``x ~ (d sc) q - (dmin m)`` from their min (at most 0) and max, sc and m 6-bit steps of the super-block's largest."""
    x = w.reshape(-1, 8, 32)
    low, high = np.minimum(x.min(-1), 0), x.max(-1)
    d = ((high - low).max(-1) / 15 / 63).astype(np.float16).astype(np.float32)
    dmin = ((-low).max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(_divide((high - low) / 15, d[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_divide(-low, dmin[:, None])), 0, 63).astype(np.uint8)
    q = np.clip(np.round(_divide(x + (dmin[:, None] * m)[..., None], (d[:, None] * sc)[..., None])), 0, 15).astype(np.uint8)
    scales = np.zeros((len(x), 12), np.uint8)  # get_scale_min_k4's packing
    for j in range(4):
        scales[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        scales[:, j + 4] = m[:, j] | ((m[:, j + 4] >> 4) << 6)
        scales[:, j + 8] = (sc[:, j + 4] & 15) | ((m[:, j + 4] & 15) << 4)
    q = q.reshape(-1, 4, 2, 32)  # sub-block 2 c + h is nibble h of bytes 32 c ..
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), scales, (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)], 1)


def quantized(w: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> QuantizedWeight:
    """``w`` float ``[rows, K]`` as ``qtype`` blocks (Q4_K / Q6_K: this module's writers; other types: gguf-py's quantizer)."""
    x = w.float().numpy()
    rows, k = x.shape
    blocks = {Q.Q6_K: q6_k_blocks, Q.Q4_K: q4_k_blocks}.get(qtype, lambda a: quantize(a, qtype))(x)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(blocks).reshape(rows, k // block, nbytes)))


def relative_errors(weights: dict, dense: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per block type name (``"Q4_K"``, ...), the mean relative error ``mean |dequantized - w| / mean |w|``
    of each `QuantizedWeight` in ``weights`` (name -> weight, as `requantized` returns; other values are
    skipped) against the float tensor of the same name and shape in ``dense``. Raises ``KeyError`` for a
    quantized name ``dense`` lacks."""
    errors: dict[str, list[float]] = {}
    for name, weight in weights.items():
        if isinstance(weight, QuantizedWeight):
            w = dense[name].float()
            errors.setdefault(weight.qtype.name, []).append(float((weight.dequantize() - w).abs().mean() / w.abs().mean()))
    return errors


def block_type(mix: str, name: str, num_layers: int) -> gguf.GGMLQuantizationType:
    """The tensor's type in ``mix`` (see the module docstring)."""
    layer = int(name.split(".")[2]) if ".layers." in name else -1
    more_bits = layer >= 0 and (layer < num_layers // 8 or layer >= num_layers - num_layers // 8 or layer % 3 == 2)
    if mix == "q6_k":
        return Q.Q6_K if "down_proj" in name else Q.Q8_0
    if "down_proj" in name:
        return Q.Q6_K if more_bits else Q.Q4_K
    if "v_proj" in name or "embed" in name:
        return Q.Q8_0 if more_bits or "embed" in name else Q.Q5_0
    return Q.Q5_0


def requantized(dense: dict[str, torch.Tensor], mix: str, num_layers: int) -> dict:
    """The float32 weights ``dense`` with every matrix in ``mix``'s block type (`block_type`), the rest in bfloat16."""
    return {name: quantized(t, block_type(mix, name, num_layers)) if t.dim() == 2 else t.bfloat16() for name, t in dense.items()}


def embedded_weights(mix: str) -> tuple[ModelConfig, dict]:
    """The embedded model's config and weights in ``mix`` (one of `MIXES`: ``stored`` keeps the file's
    blocks and bfloat16 norms)."""
    if mix == "stored":
        return load_weights(embedded_model_path(), torch.bfloat16, keep_quantized=True)
    config, dense = load_weights(embedded_model_path(), torch.float32)
    return config, requantized(dense, mix, config.num_layers)
