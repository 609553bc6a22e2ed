"""Weight-only quantized weights: GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and K-quant (Q4_K/Q5_K/Q6_K) blocks as
they are stored, and the formats the model's quantized linears take (`quant_linear.QuantizedLinear` runs them).

A GGUF file's block-quantized weights reach the model as `QuantizedWeight` (the blocks as stored)
and become, once at load, one of these formats with groups of 32 along K (GGUF's block length):

- **Q4_0 / Q4_1 → int4** (`Int4Weight`, ``w = q * scale + offset``): Q4_0's ``w = d * (q - 8)`` is
  ``scale = d, offset = -8 d``; Q4_1's ``w = d * q + m`` is ``scale = d, offset = m``. Exact.
- **Q5_0 / Q5_1 → int5** (`Int5Weight`, the same with ``q`` in 0..31; Q5_0's offset ``-16 d``). Exact.
- **Q8_0 → int8** (`Int8Weight`, ``w = q * scale``): ``scale = d``. Exact.
- **Q4_K / Q5_K / Q6_K → K-quant** (`KQuantWeight`): the super-blocks of 256 with their sub-block
  scales unpacked to one byte each (ggml-quants.c ``get_scale_min_k4``), the values to one byte. Exact.
- **int4 / int8 from float weights** (``--weights int4|int8`` on any checkpoint): round to nearest,
  asymmetric min/max groups for int4 (as Q4_1 quantizes), symmetric groups for int8 (as Q8_0 does).

The parts of one fused linear (q/k/v, gate/up) of different block types meet in the narrowest
format that holds all of them exactly, or run side by side where none does (`_concat`): Q4_K_M
files store attn_v as Q6_K (or, where K is not a multiple of 256, Q8_0) beside Q4_K (Q5_0) q and k. Where a kernel rounds further (float16
scales, torch's kernels' bfloat16 scales or per-row int8) is said in `quant_linear`.
"""

from __future__ import annotations

import dataclasses
import itertools

import gguf
import torch

from stageserve.device.flags import WEIGHT_FORMATS

Q = gguf.GGMLQuantizationType
GROUP = 32  # GGUF's block length along K, and the formats' group size
SUPER = 256  # the K-quants' super-block length along K (ggml's QK_K)
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
KEPT_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0) + K_TYPES  # GGUF block types that map onto a kernel here


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A GGUF block-quantized weight as stored: ``blocks`` uint8 ``[rows, K / block, block_bytes]`` of
    ``qtype`` (block 32, or 256 for the K-quants).

    Block layouts (ggml-common.h; every ``d``, ``m``, ``dmin`` float16):

    - Q8_0 = ``d`` + 32 int8 (``w = d q``); Q4_0 = ``d`` + 16 bytes of nibbles (``w = d (q - 8)``);
      Q4_1 = ``d``, ``m`` + nibbles (``w = d q + m``); nibble ``j`` of a block sits in byte ``j % 16``,
      the low half for ``j < 16``. Q5_0 / Q5_1 = ``d`` (, ``m``) + 4 bytes ``qh`` (bit ``j`` of the
      little-endian uint32: bit 4 of ``q_j``) + the nibbles; ``w = d (q - 16)`` / ``d q + m``.
    - Q4_K (144 bytes) = ``d``, ``dmin``, 12 bytes of 6-bit ``sc``/``m`` for 8 sub-blocks of 32
      (`_scale_min_k4`), 128 bytes ``qs``: sub-block ``2c + h`` is the low (``h = 0``) or high nibbles
      of bytes ``32c..32c+31``; ``w = (d sc) q - (dmin m)``. Q5_K (176) = the same with 32 bytes
      ``qh`` before ``qs``: bit ``j`` of ``qh[l]`` is bit 4 of sub-block ``j``'s ``q_l``.
    - Q6_K (210) = 128 bytes ``ql`` (the values' low nibbles), 64 ``qh`` (their 2 high bits), 16
      int8 ``sc`` (one per 16 values), ``d``; which value sits where: `_unpack_q6_k`; ``w = (d sc) (q - 32)``.
    """

    qtype: gguf.GGMLQuantizationType
    blocks: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, K)``, the weight's ``[out_features, in_features]``."""
        return self.blocks.shape[0], self.blocks.shape[1] * gguf.GGML_QUANT_SIZES[self.qtype][0]

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 ``[rows, K]``, computed in float32 in ``gguf.quants.dequantize``'s order (bit for bit)."""
        blocks = self.blocks.reshape(-1, self.blocks.shape[-1])
        if self.qtype == Q.Q8_0:
            return (blocks[:, 2:].view(torch.int8).float() * _f16_column(blocks, 0)).view(self.shape)
        if self.qtype in K_TYPES:
            k = kquant_from_gguf(QuantizedWeight(self.qtype, blocks.view(-1, 1, blocks.shape[-1])))
            return k.dequantize().view(self.shape)
        q = _nibbles(blocks).float() if self.qtype in (Q.Q4_0, Q.Q4_1) else _q5_values(blocks).float()
        if self.qtype in (Q.Q4_0, Q.Q5_0):
            return ((q - (8.0 if self.qtype == Q.Q4_0 else 16.0)) * _f16_column(blocks, 0)).view(self.shape)
        return torch.addcmul(_f16_column(blocks, 2), q, _f16_column(blocks, 0)).view(self.shape)


def dequantized(t: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """``t`` as a plain tensor: a `QuantizedWeight` dequantized (float32, its shape), a tensor as it is."""
    return t.dequantize() if isinstance(t, QuantizedWeight) else t


def from_gguf_bytes(raw: torch.Tensor, qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...]) -> QuantizedWeight:
    """Wrap a tensor's GGUF bytes (uint8 ``[nbytes]``) of a `KEPT_TYPES` type and 2-D ``shape`` (a copy)."""
    rows, k = shape
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    return QuantizedWeight(qtype, raw.view(rows, k // block, block_bytes).clone())


def _nibbles(blocks: torch.Tensor) -> torch.Tensor:
    """The 32 4-bit values of each Q4_0/Q4_1 block (uint8 ``[n, bytes]``) as uint8 ``[n, 32]``."""
    qs = blocks[:, -16:]
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def _q5_values(blocks: torch.Tensor) -> torch.Tensor:
    """The 32 5-bit values of each Q5_0/Q5_1 block (uint8 ``[n, bytes]``) as uint8 ``[n, 32]``."""
    qh = blocks[:, -20:-16]  # the little-endian uint32 whose bit j is bit 4 of value j
    high = (qh[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return _nibbles(blocks) | (high.reshape(-1, GROUP) << 4)


def _f16_column(blocks: torch.Tensor, byte: int) -> torch.Tensor:
    """The float16 stored at ``byte`` of each block (uint8 ``[n, bytes]``) as float32 ``[n, 1]``."""
    return blocks[:, byte : byte + 2].contiguous().view(torch.float16).float()


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes per super-block (uint8 ``[n, 12]``) as the 8 sub-blocks' 6-bit
    ``sc`` and ``m`` (uint8 ``[n, 8]`` each): ggml-quants.c ``get_scale_min_k4``. Bytes 0-3 hold
    ``sc`` 0-3 in their low 6 bits, bytes 4-7 ``m`` 0-3; sub-blocks 4-7 take their low 4 bits from
    the nibbles of bytes 8-11 and their high 2 bits from the top bits of bytes 0-3 (``sc``) and 4-7 (``m``)."""
    d, m, md = scales.view(-1, 3, 4).unbind(1)
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), 1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), 1)
    return sc, mn


def _unpack_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K's 256 6-bit values per block (uint8 ``[n, 210]``) as uint8 ``[n, 256]`` in 0..63 (``q + 32``):
    value ``128 h + 32 s + l`` (``h`` 0..1, ``s`` 0..3, ``l`` 0..31) takes nibble ``s // 2`` of
    ``ql[64 h + 32 (s % 2) + l]`` and bits ``2 s, 2 s + 1`` of ``qh[32 h + l]`` (ggml-quants.c ``dequantize_row_q6_K``)."""
    n = blocks.shape[0]
    ql = blocks[:, :128].reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    return (ql & 0x0F).reshape(n, SUPER) | ((qh & 0x03).reshape(n, SUPER) << 4)


# ---- kernel formats ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """``w = q * scale + offset`` per group of 32 along K: ``q`` uint8 ``[N, K]`` in 0..15, ``scale``/``offset`` float32 ``[N, K / 32]``."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Int5Weight:
    """``w = q * scale + offset`` per group of 32 along K: ``q`` uint8 ``[N, K]`` in 0..31, ``scale``/``offset`` float32 ``[N, K / 32]``."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """``w = q * scale`` per group of 32 along K: ``q`` int8 ``[N, K]``, ``scale`` float32 ``[N, K / 32]``."""

    q: torch.Tensor
    scale: torch.Tensor


@dataclasses.dataclass(frozen=True)
class KQuantWeight:
    """llama.cpp's K-quant super-blocks of 256 along K, each field unpacked to whole bytes (``S = K / 256``):

    - Q4_K / Q5_K: ``q`` uint8 ``[N, K]`` in 0..15 / 0..31, ``d``/``dmin`` float16 ``[N, S]``, ``sc``/``m``
      uint8 ``[N, K / 32]`` in 0..63; ``w = (d sc) q - (dmin m)`` per sub-block of 32.
    - Q6_K: ``q`` uint8 ``[N, K]`` in 0..63, ``d`` float16 ``[N, S]``, ``sc`` int8 ``[N, K / 16]``,
      ``dmin``/``m`` empty ``[N, 0]``; ``w = (d sc) (q - 32)`` per sub-block of 16.

    ``d sc`` and ``dmin m`` are exact in float32 (11-bit significands times 6 or 8 bits), as ggml computes them.
    """

    qtype: gguf.GGMLQuantizationType
    q: torch.Tensor
    d: torch.Tensor
    sc: torch.Tensor
    dmin: torch.Tensor
    m: torch.Tensor

    @property
    def bits(self) -> int:
        """Bits per value: 4, 5 or 6."""
        return {Q.Q4_K: 4, Q.Q5_K: 5, Q.Q6_K: 6}[self.qtype]

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 ``[N, K]`` in ``gguf.quants.dequantize``'s order of float32 operations (bit for bit)."""
        n, k = self.q.shape
        sub = k // self.sc.shape[1]
        d = self.d.float().repeat_interleave(SUPER // sub, 1) * self.sc.float()  # [N, K / sub]
        q = self.q.float().view(n, -1, sub)
        if self.qtype == Q.Q6_K:
            return (d[..., None] * (q - 32)).view(n, k)
        dm = self.dmin.float().repeat_interleave(SUPER // sub, 1) * self.m.float()
        return (d[..., None] * q - dm[..., None]).view(n, k)


def offset_groups_from_gguf(weight: QuantizedWeight) -> Int4Weight | Int5Weight:
    """Q4_0/Q4_1 blocks as `Int4Weight`, Q5_0/Q5_1 as `Int5Weight`, exactly (see the module docstring)."""
    n, groups = weight.blocks.shape[:2]
    blocks = weight.blocks.reshape(n * groups, -1)
    d = _f16_column(blocks, 0).view(n, groups)
    four = weight.qtype in (Q.Q4_0, Q.Q4_1)
    if weight.qtype in (Q.Q4_0, Q.Q5_0):
        offset = (-8 if four else -16) * d
    else:
        offset = _f16_column(blocks, 2).view(n, groups)
    q = (_nibbles(blocks) if four else _q5_values(blocks)).view(n, groups * GROUP)
    return (Int4Weight if four else Int5Weight)(q, d, offset)


def int8_from_gguf(weight: QuantizedWeight) -> Int8Weight:
    """Q8_0 blocks as `Int8Weight`, exactly."""
    n, groups = weight.blocks.shape[:2]
    blocks = weight.blocks.reshape(n * groups, -1)
    return Int8Weight(blocks[:, 2:].contiguous().view(torch.int8).view(n, groups * GROUP), _f16_column(blocks, 0).view(n, groups))


def kquant_from_gguf(weight: QuantizedWeight) -> KQuantWeight:
    """Q4_K/Q5_K/Q6_K blocks as `KQuantWeight` (layouts: `QuantizedWeight`)."""
    n, supers = weight.blocks.shape[:2]
    blocks = weight.blocks.reshape(n * supers, -1)
    if weight.qtype == Q.Q6_K:
        empty = torch.empty(n, 0, dtype=torch.uint8)
        d = blocks[:, 208:210].contiguous().view(torch.float16).view(n, supers)
        sc = blocks[:, 192:208].contiguous().view(torch.int8).view(n, supers * 16)
        return KQuantWeight(weight.qtype, _unpack_q6_k(blocks).view(n, supers * SUPER), d, sc, empty, empty)
    d, dmin = blocks[:, 0:4].contiguous().view(torch.float16).view(n, supers, 2).unbind(-1)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    qs = blocks[:, -128:].reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(-1, SUPER)
    if weight.qtype == Q.Q5_K:  # bit j of qh[l]: bit 4 of sub-block j's value l
        qh = blocks[:, 16:48].reshape(-1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
        q = q | ((qh & 1).reshape(-1, SUPER) << 4)
    return KQuantWeight(weight.qtype, q.view(n, supers * SUPER), d.contiguous(), sc.reshape(n, -1), dmin.contiguous(), mn.reshape(n, -1))


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


@dataclasses.dataclass(frozen=True)
class StackedWeight:
    """Consecutive row ranges of one linear in formats no single one holds exactly (Q4_K beside Q6_K),
    each ``[N_i, K]`` in its own format and run on its own kernel, the outputs side by side."""

    parts: tuple[Int4Weight | Int5Weight | Int8Weight | KQuantWeight, ...]


KernelWeight = Int4Weight | Int5Weight | Int8Weight | KQuantWeight | StackedWeight


def weight_shape(weight: KernelWeight) -> tuple[int, int]:
    """``(N, K)`` of a kernel-format weight."""
    if isinstance(weight, StackedWeight):
        return sum(weight_shape(p)[0] for p in weight.parts), weight_shape(weight.parts[0])[1]
    return tuple(weight.q.shape)


def kernel_weight(parts: list[torch.Tensor | QuantizedWeight], weight_format: str) -> KernelWeight | None:
    """The parts of one linear (stacked along N) in the kernel format ``weight_format`` asks for; ``None`` for dense.

    ``auto``: GGUF Q4_0/Q4_1 → int4, Q5_0/Q5_1 → int5, Q8_0 → int8, Q4_K/Q5_K/Q6_K → K-quant; parts
    of different formats in the narrowest that holds them all exactly, else side by side (`_concat`);
    dense when any part is a float tensor. ``int4`` / ``int8``: every weight in that format (GGUF types of
    that format mapped exactly, anything else rounded from its float values). ``dequantize``: always ``None``.

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


_FROM_GGUF = {Q.Q4_0: ("int4", offset_groups_from_gguf), Q.Q4_1: ("int4", offset_groups_from_gguf), Q.Q5_0: ("int5", offset_groups_from_gguf),
              Q.Q5_1: ("int5", offset_groups_from_gguf), Q.Q8_0: ("int8", int8_from_gguf)} | {t: ("k", kquant_from_gguf) for t in K_TYPES}


def _convert(part: torch.Tensor | QuantizedWeight, weight_format: str) -> KernelWeight:
    if isinstance(part, QuantizedWeight):
        fmt, convert = _FROM_GGUF[part.qtype]
        if weight_format in ("auto", fmt):
            return convert(part)
    dense = dequantized(part)
    return int4_from_float(dense) if weight_format == "int4" else int8_from_float(dense)


def _concat(parts: list[KernelWeight]) -> KernelWeight:
    """The parts stacked along N (q/k/v, gate/up) in one format where one holds them all exactly, else
    as a `StackedWeight` of runs of one format. int4 values are int5 values; a symmetric int4/int5
    part (Q4_0, Q5_0: ``offset = -8 / -16 scale``) is int8 ``q - 8 / q - 16``; Q4_K values are Q5_K
    values. Q4_K/Q5_K (a minimum per sub-block) and Q6_K (none, scales per 16) hold no other."""
    kinds = {format_name(p) for p in parts}
    if len(kinds) > 1:
        if kinds <= {"int4", "int5"}:
            parts = [Int5Weight(p.q, p.scale, p.offset) for p in parts]
        elif kinds <= {"int4", "int5", "int8"} and all(is_symmetric(p) for p in parts):
            parts = [p if isinstance(p, Int8Weight) else Int8Weight(p.q.to(torch.int8) - (8 if isinstance(p, Int4Weight) else 16), p.scale)
                     for p in parts]
        elif kinds == {"q4_k", "q5_k"}:
            parts = [dataclasses.replace(p, qtype=Q.Q5_K) for p in parts]
        else:
            runs = [list(run) for _, run in itertools.groupby(parts, format_name)]
            return StackedWeight(tuple(_concat(run) for run in runs))
    first = parts[0]
    fields = [f.name for f in dataclasses.fields(first) if f.name != "qtype"]
    stacked = {name: torch.cat([getattr(p, name) for p in parts]) for name in fields}
    return dataclasses.replace(first, **stacked)


def is_symmetric(weight: Int4Weight | Int5Weight | Int8Weight) -> bool:
    """Whether every group's offset is ``-2^(bits - 1) scale`` (GGUF's Q4_0 / Q5_0; int8 always is:
    ``w = q scale`` with ``q`` signed), so that ``scale`` alone holds the weight: ``w = scale (q - 2^(bits - 1))``
    for int4 / int5's unsigned ``q``. Compares all ``[N, K / 32]`` offsets exactly (a load-time check)."""
    if isinstance(weight, Int8Weight):
        return True
    return torch.equal(weight.offset, weight.scale * (-8 if isinstance(weight, Int4Weight) else -16))


def format_name(weight: KernelWeight) -> str:
    """``"int4"``, ``"int5"``, ``"int8"``, ``"q4_k"``, ``"q5_k"`` or ``"q6_k"``; a `StackedWeight`'s joined by ``+``."""
    if isinstance(weight, StackedWeight):
        return "+".join(format_name(p) for p in weight.parts)
    if isinstance(weight, KQuantWeight):
        return weight.qtype.name.lower()
    return {Int4Weight: "int4", Int5Weight: "int5", Int8Weight: "int8"}[type(weight)]
