"""Weight-only quantized weights: GGUF's Q4_0/Q4_1/Q8_0 blocks as they are stored, and the int4 and
int8 formats the model's quantized linears take (`quant_linear.QuantizedLinear` runs them).

A GGUF file's block-quantized weights reach the model as `QuantizedWeight` (the blocks as stored)
and become, once at load, one of two formats with groups of 32 along K (GGUF's block length):

- **Q4_0 / Q4_1 → int4** (`Int4Weight`, ``w = q * scale + offset``): Q4_0's ``w = d * (q - 8)`` is
  ``scale = d, offset = -8 d``; Q4_1's ``w = d * q + m`` is ``scale = d, offset = m``. Exact.
- **Q8_0 → int8** (`Int8Weight`, ``w = q * scale``): ``scale = d``. Exact.
- **int4 / int8 from float weights** (``--weights int4|int8`` on any checkpoint): round to nearest,
  asymmetric min/max groups for int4 (as Q4_1 quantizes), symmetric groups for int8 (as Q8_0 does).

Where a kernel rounds further (float16 scales, torch's kernels' bfloat16 scales or per-row int8) is
said in `quant_linear`.
"""

from __future__ import annotations

import dataclasses
import gguf
import torch

from stageserve.device.flags import WEIGHT_FORMATS

Q = gguf.GGMLQuantizationType
GROUP = 32  # GGUF's block length along K, and the formats' group size
KEPT_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # GGUF block types that map onto a kernel here
_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q8_0: 34}


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A GGUF block-quantized weight as stored: ``blocks`` uint8 ``[rows, K / 32, block_bytes]`` of ``qtype``.

    Block layouts (ggml-quants.c): Q8_0 = float16 ``d`` + 32 int8 (``w = d q``); Q4_0 = ``d`` + 16
    bytes of nibbles (``w = d (q - 8)``); Q4_1 = ``d``, float16 ``m`` + nibbles (``w = d q + m``);
    nibble ``j`` of a block sits in byte ``j % 16``, the low half for ``j < 16``.
    """

    qtype: gguf.GGMLQuantizationType
    blocks: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, K)``, the weight's ``[out_features, in_features]``."""
        return self.blocks.shape[0], self.blocks.shape[1] * GROUP

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 ``[rows, K]``, computed in float32 as ggml does."""
        blocks = self.blocks.reshape(-1, self.blocks.shape[-1])
        if self.qtype == Q.Q8_0:
            return (blocks[:, 2:].view(torch.int8).float() * _f16_column(blocks, 0)).view(self.shape)
        q = _nibbles(blocks).float()
        if self.qtype == Q.Q4_0:
            return ((q - 8.0) * _f16_column(blocks, 0)).view(self.shape)
        return torch.addcmul(_f16_column(blocks, 2), q, _f16_column(blocks, 0)).view(self.shape)


def from_gguf_bytes(raw: torch.Tensor, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> QuantizedWeight:
    """Wrap a tensor's GGUF bytes (uint8 ``[nbytes]``) of a `KEPT_TYPES` type and 2-D ``shape`` (a copy)."""
    rows, k = shape
    return QuantizedWeight(qtype, raw.view(rows, k // GROUP, _BLOCK_BYTES[qtype]).clone())


def _nibbles(blocks: torch.Tensor) -> torch.Tensor:
    """The 32 4-bit values of each Q4_0/Q4_1 block (uint8 ``[n, bytes]``) as uint8 ``[n, 32]``."""
    qs = blocks[:, -16:]
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _f16_column(blocks: torch.Tensor, byte: int) -> torch.Tensor:
    """The float16 stored at ``byte`` of each block (uint8 ``[n, bytes]``) as float32 ``[n, 1]``."""
    return blocks[:, byte : byte + 2].contiguous().view(torch.float16).float()


# ---- kernel formats ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """``w = q * scale + offset`` per group of 32 along K: ``q`` uint8 ``[N, K]`` in 0..15, ``scale``/``offset`` float32 ``[N, K / 32]``."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """``w = q * scale`` per group of 32 along K: ``q`` int8 ``[N, K]``, ``scale`` float32 ``[N, K / 32]``."""

    q: torch.Tensor
    scale: torch.Tensor


def int4_from_gguf(weight: QuantizedWeight) -> Int4Weight:
    """Q4_0/Q4_1 blocks as `Int4Weight`, exactly (see the module docstring)."""
    n, groups = weight.blocks.shape[:2]
    blocks = weight.blocks.reshape(n * groups, -1)
    d = _f16_column(blocks, 0).view(n, groups)
    offset = -8 * d if weight.qtype == Q.Q4_0 else _f16_column(blocks, 2).view(n, groups)
    return Int4Weight(_nibbles(blocks).view(n, groups * GROUP), d, offset)


def int8_from_gguf(weight: QuantizedWeight) -> Int8Weight:
    """Q8_0 blocks as `Int8Weight`, exactly."""
    n, groups = weight.blocks.shape[:2]
    blocks = weight.blocks.reshape(n * groups, -1)
    return Int8Weight(blocks[:, 2:].contiguous().view(torch.int8).view(n, groups * GROUP), _f16_column(blocks, 0).view(n, groups))


def int4_from_float(weight: torch.Tensor) -> Int4Weight:
    """Round ``weight`` ``[N, K]`` (K a multiple of 32) to 4 bits per asymmetric group of 32 (Q4_1's rule)."""
    n, k = weight.shape
    w = weight.float().view(n, k // GROUP, GROUP)
    low, high = w.amin(-1), w.amax(-1)
    scale = (high - low) / 15
    q = ((w - low[..., None]) / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round_().clamp_(0, 15)
    return Int4Weight(q.to(torch.uint8).view(n, k), scale, low)


def int8_from_float(weight: torch.Tensor) -> Int8Weight:
    """Round ``weight`` ``[N, K]`` (K a multiple of 32) to int8 per symmetric group of 32 (``max |w| / 127``; Q8_0's rule)."""
    n, k = weight.shape
    q, scale = round_symmetric_int8(weight.float().view(n, k // GROUP, GROUP))
    return Int8Weight(q.view(n, k), scale)


def round_symmetric_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` float32 ``[..., L]`` rounded to nearest on one symmetric scale per last-dim slice:
    ``q`` int8 ``[..., L]`` in -127..127 and ``scale = max |w| / 127`` float32 ``[...]`` (``w ~ q * scale``)."""
    scale = w.abs().amax(-1) / 127
    q = (w / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round_().clamp_(-127, 127)
    return q.to(torch.int8), scale


def kernel_weight(parts: list[torch.Tensor | QuantizedWeight], weight_format: str) -> Int4Weight | Int8Weight | None:
    """The parts of one linear (stacked along N) in the kernel format ``weight_format`` asks for; ``None`` for dense.

    ``auto``: GGUF Q4_0/Q4_1 → int4, Q8_0 → int8; dense when any part is a float tensor or the parts
    map onto different formats. ``int4`` / ``int8``: every weight in that format (GGUF types of that
    format mapped exactly, anything else rounded from its float values). ``dequantize``: always ``None``.

    Raises:
        ValueError: an unknown ``weight_format``.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_format!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
    if weight_format == "dequantize":
        return None
    if weight_format == "auto" and not all(isinstance(p, QuantizedWeight) for p in parts):
        return None
    return _concat([_convert(p, weight_format) for p in parts])


def _convert(part: torch.Tensor | QuantizedWeight, weight_format: str) -> Int4Weight | Int8Weight:
    if isinstance(part, QuantizedWeight):
        if part.qtype == Q.Q8_0 and weight_format in ("auto", "int8"):
            return int8_from_gguf(part)
        if part.qtype != Q.Q8_0 and weight_format in ("auto", "int4"):
            return int4_from_gguf(part)
    dense = part.dequantize() if isinstance(part, QuantizedWeight) else part
    return int4_from_float(dense) if weight_format == "int4" else int8_from_float(dense)


def _concat(parts: list[Int4Weight | Int8Weight]) -> Int4Weight | Int8Weight | None:
    """The parts stacked along N (q/k/v, gate/up), or ``None`` when they are not all one format."""
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts):
        return None
    return kind(*(torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(kind)))


def format_name(weight: Int4Weight | Int8Weight) -> str:
    """``"int4"`` or ``"int8"``."""
    return "int4" if isinstance(weight, Int4Weight) else "int8"
