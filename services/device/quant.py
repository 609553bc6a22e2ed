"""Weight-only quantized linears: GGUF's Q4_0/Q4_1 on torch's int4 CPU kernel, Q8_0 on its int8 kernel.

A GGUF file's block-quantized weights reach the model as `QuantizedWeight` (the blocks as stored)
and are repacked once, at load, into the layout of a kernel torch ships:

- **Q4_0 / Q4_1 → int4, groups of 32 along K** (``torch.ops.aten._weight_int4pack_mm_for_cpu``,
  which computes ``w = (q - 8) * scale + zero`` per group). Q4_0's ``w = d * (q - 8)`` is
  ``scale = d, zero = 0``; Q4_1's ``w = d * q + m`` is ``scale = d, zero = m + 8 d``. The mapping is
  exact except that the kernel takes scale and zero in the activation dtype: in bfloat16 each group's
  float16 ``d`` (and ``m + 8 d``) is rounded to 8 significant bits, a relative change of at most
  2**-9 of the group's weights: the same bound as rounding each dequantized weight to bfloat16, which
  the dequantizing path does.
- **Q8_0 → int8 per output channel** (``torch.ops.aten._weight_int8pack_mm``, one scale per row):
  the kernel has no groups, so each row is requantized to the scale of its largest weight,
  ``s = max |d_g q| / 127``, ``q' = round(d_g q / s)``: an absolute error of at most ``s / 2`` per
  weight (Q8_0's own is ``d_g / 2``), i.e. 8 bits per row instead of per 32 weights.
- **int4 / int8 from float weights** (``--weights int4|int8`` on any checkpoint): round to nearest,
  asymmetric min/max groups of 32 for int4 (as Q4_1 quantizes), symmetric per row for int8.

Both kernels read their weight once per call but do a fixed amount of work per input row (no
reuse across rows), so they win only for few rows; `QuantizedLinear` runs inputs of more rows on a
dense copy where the model keeps one, else on a weight dequantized for that call (`dense_weight`).
The row limits are measured (docs/backends.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import gguf
import torch
import torch.nn.functional as F

Q = gguf.GGMLQuantizationType
GROUP = 32  # GGUF's block length along K, and the int4 kernel's group size
INT4_ROW_BLOCK = 64  # the int4 CPU kernel packs rows in blocks of 64 ([N / 64, K, 32] bytes)
KEPT_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q8_0)  # GGUF block types that map onto a kernel here
# Inputs of more rows than these run dense (docs/backends.md#quantized-weights---weights: measured, CPU
# time of a model's 120 linears on one thread, weights cold: int4 10.7 / 15.9 / 17.0 / 33.3 ms at 1 / 2 / 4 / 8
# rows against 19.6 / 20.1 / 22.4 / 20.1 ms for the bfloat16 AMX kernel).
INT4_MAX_ROWS = 4
INT8_MAX_ROWS = 4
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
    """``w = (q - 8) * scale + zero``: ``q`` uint8 ``[N, K]`` in 0..15, ``scale``/``zero`` float32 ``[N, K / 32]``."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """``w = q * scale``: ``q`` int8 ``[N, K]``, ``scale`` float32 ``[N]``."""

    q: torch.Tensor
    scale: torch.Tensor


def int4_from_gguf(weight: QuantizedWeight) -> Int4Weight:
    """Q4_0/Q4_1 blocks as `Int4Weight`, exactly (see the module docstring)."""
    n, groups = weight.blocks.shape[:2]
    blocks = weight.blocks.reshape(n * groups, -1)
    d = _f16_column(blocks, 0).view(n, groups)
    zero = torch.zeros_like(d) if weight.qtype == Q.Q4_0 else _f16_column(blocks, 2).view(n, groups) + 8 * d
    return Int4Weight(_nibbles(blocks).view(n, groups * GROUP), d, zero)


def int4_from_float(weight: torch.Tensor) -> Int4Weight:
    """Round ``weight`` ``[N, K]`` (K a multiple of 32) to 4 bits per asymmetric group of 32 (Q4_1's rule)."""
    n, k = weight.shape
    w = weight.float().view(n, k // GROUP, GROUP)
    low, high = w.amin(-1), w.amax(-1)
    scale = (high - low) / 15
    q = ((w - low[..., None]) / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round_().clamp_(0, 15)
    return Int4Weight(q.to(torch.uint8).view(n, k), scale, low + 8 * scale)


def int8_from_float(weight: torch.Tensor) -> Int8Weight:
    """Round ``weight`` ``[N, K]`` to int8 with one symmetric scale per row (``max |w| / 127``)."""
    w = weight.float()
    scale = w.abs().amax(-1) / 127
    q = (w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).round_().clamp_(-127, 127)
    return Int8Weight(q.to(torch.int8), scale)


WEIGHT_FORMATS = ("auto", "dequantize", "int8", "int4")


def kernel_weight(parts: list[torch.Tensor | QuantizedWeight], weight_format: str) -> Int4Weight | Int8Weight | None:
    """The parts of one linear (stacked along N) in the kernel format ``weight_format`` asks for; ``None`` for dense.

    ``auto``: GGUF Q4_0/Q4_1 → int4, Q8_0 → int8 (requantized per row); dense when any part is a
    float tensor or the parts map onto different formats. ``int4`` / ``int8``: every weight in that
    format (Q4_0/Q4_1 mapped exactly to int4, anything else rounded from its float values).
    ``dequantize``: always ``None``. Also ``None`` when an int4 weight's shape does not suit the kernel.

    Raises:
        ValueError: an unknown ``weight_format``.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_format!r}: expected one of {', '.join(WEIGHT_FORMATS)}")
    if weight_format == "dequantize":
        return None
    if weight_format == "auto" and not all(isinstance(p, QuantizedWeight) for p in parts):
        return None
    converted = [_convert(p, weight_format) for p in parts]
    stacked = _concat(converted)
    if isinstance(stacked, Int4Weight) and not int4_fits(stacked.q.shape):
        return None
    return stacked


def _convert(part: torch.Tensor | QuantizedWeight, weight_format: str) -> Int4Weight | Int8Weight:
    if isinstance(part, QuantizedWeight) and part.qtype != Q.Q8_0 and weight_format in ("auto", "int4"):
        return int4_from_gguf(part)
    dense = part.dequantize() if isinstance(part, QuantizedWeight) else part
    if weight_format == "int4":
        return int4_from_float(dense)
    return int8_from_float(dense)  # int8, or auto on Q8_0


def _concat(parts: list[Int4Weight | Int8Weight]) -> Int4Weight | Int8Weight | None:
    """The parts stacked along N (q/k/v, gate/up), or ``None`` when they are not all one format."""
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts):
        return None
    return kind(*(torch.cat([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(kind)))


def format_name(weight: Int4Weight | Int8Weight) -> str:
    """``"int4"`` or ``"int8"``."""
    return "int4" if isinstance(weight, Int4Weight) else "int8"


# ---- the linear ------------------------------------------------------------------------------------
class QuantizedLinear:
    """``y = x @ w.T + bias`` with ``w`` held as int4 or int8 for torch's weight-only CPU kernels.

    Inputs of at most ``max_rows`` rows (default `INT4_MAX_ROWS` / `INT8_MAX_ROWS`, measured) run on
    the quantized kernel; larger ones on a dense copy when ``dense_copy`` makes one, else on a weight
    dequantized for that call (`dense_weight`, the memory-lean choice). Either way the dense weight
    holds the quantized values (`dense_weight`), so every row count computes with the same weights.
    """

    def __init__(self, weight: Int4Weight | Int8Weight, bias: torch.Tensor | None, dtype: torch.dtype, max_rows: int | None = None,
                 dense_copy: Callable[[torch.Tensor], Any] | None = None) -> None:
        """``weight`` in a kernel format, ``bias`` [N] of ``dtype`` or ``None``; ``dtype`` is the activations'.
        ``dense_copy``: builds the dense linear (e.g. ``model.Linear``) from the dequantized weight [N, K].

        Raises:
            ValueError: an int4 weight whose N is not a multiple of 64 or K not of 32 (see `int4_fits`).
        """
        self.int4 = isinstance(weight, Int4Weight)
        self.bias, self.dtype = bias, dtype
        self.max_rows = max_rows if max_rows is not None else INT4_MAX_ROWS if self.int4 else INT8_MAX_ROWS
        self.out_features, self.in_features = weight.q.shape
        if self.int4:
            if not int4_fits(weight.q.shape):
                raise ValueError(f"int4 weight of shape {tuple(weight.q.shape)}: rows must be a multiple of {INT4_ROW_BLOCK}, columns of {GROUP}")
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 1)  # uint8 [N / 64, K, 32] (as [N, K / 2])
            self.scale = torch.stack((weight.scale.t(), weight.zero.t()), -1).to(dtype).contiguous()  # [K / 32, N, 2]: scale, zero
        else:
            self.packed, self.scale = weight.q.contiguous(), weight.scale.to(dtype)  # int8 [N, K], [N]
        self.dense = None if dense_copy is None else dense_copy(self.dense_weight())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this linear holds (for memory accounting)."""
        return [t for t in (self.packed, self.scale, self.bias) if t is not None] + (self.dense.tensors() if self.dense is not None else [])

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] int64 of an int8 weight, dequantized: [T, in] of ``dtype`` (a tied embedding table)."""
        return self.packed[ids].to(self.dtype) * self.scale[ids, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] of ``dtype`` -> [T, out]."""
        if x.shape[0] > self.max_rows:
            return self.dense(x) if self.dense is not None else F.linear(x, self.dense_weight(), self.bias)
        if self.int4:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.packed, self.scale)
        return y if self.bias is None else y + self.bias

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this ``[gate; up]`` projection of ``x`` [T, in] -> [T, out / 2] (CPU kernels)."""
        from stageserve.device import cpu_kernels

        if x.shape[0] > self.max_rows and self.dense is not None:
            return self.dense.swiglu(x)
        return cpu_kernels.silu_and_mul(self(x))

    def dense_weight(self) -> torch.Tensor:
        """The weight dequantized to ``dtype`` ``[N, K]``, from the packed copy (no other copy is kept)."""
        if not self.int4:
            return self.packed.to(self.dtype) * self.scale[:, None]
        n, k = self.out_features, self.in_features
        blocks, groups = n // INT4_ROW_BLOCK, k // GROUP
        b = self.packed.view(blocks, k, INT4_ROW_BLOCK // 2)
        q = torch.cat((b & 0x0F, b >> 4), 2).to(self.dtype).view(blocks, groups, GROUP, INT4_ROW_BLOCK)  # row r of a block is the last index
        sz = self.scale.view(groups, blocks, 1, INT4_ROW_BLOCK, 2).transpose(0, 1)  # [N / 64, K / 32, 1, 64, 2]
        w = torch.addcmul(sz[..., 1], q - 8, sz[..., 0])  # [N / 64, K / 32, 32, 64], rounded once to dtype
        return w.permute(0, 3, 1, 2).reshape(n, k)


def int4_fits(shape: tuple[int, ...]) -> bool:
    """Whether a weight of ``shape`` ``[N, K]`` suits the int4 kernel's packing (N % 64 == 0, K % 32 == 0)."""
    return shape[0] % INT4_ROW_BLOCK == 0 and shape[1] % GROUP == 0
