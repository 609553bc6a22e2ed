"""Weight-only quantized linears (`QuantizedLinear`) and the kernels they run few-row inputs on, each
with its packed layout (the formats, from GGUF or rounded from float weights: `quant`).

- `VnniKernel`: stageserve's own (``cpu_kernels.quant_linear``, csrc/quant_linear.cpp) on x86-64
  CPUs with AVX512-VNNI (Intel Xeon since Cascade Lake, AMD EPYC since Zen 4). int4, int5 and int8
  weights keep GGUF's groups of 32 with float16 scales, so Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 map
  exactly; Q4_K, Q5_K and Q6_K keep llama.cpp's super-blocks of 256 (ggml-quants.c) with their
  sub-block scales a byte each, and map exactly too (layouts and their bytes: `VnniKernel`). Each input row
  is quantized per group of 32 as llama.cpp quantizes activations for its Q4/Q8 dot products
  (ggml-quants.c, ``quantize_row_q8_0``: ``s = max |x| / 127``, here rounding to nearest even): one
  int8 level (``input_bits=8``). A second int8 level can take what the first rounded off
  (``input_bits=16``): each input rounded to a 257th of that step, ``x ~ s (256 p + p')`` with ``s =
  max |x| / 32639``, an error of at most ``1 / 65278`` of each group's largest input, below
  bfloat16's own rounding, for twice the integer work. A row's result never depends on the other
  rows of the call, so where the kernel runs every row count a request's tokens do not depend on
  how many rows share its steps whatever the levels; where a dense copy runs the inputs of more
  rows, one level rounded differently enough from the copy to tip greedy near-ties (12 of the
  suite's concurrent-against-solo and speculative comparisons failed), two do not. So
  `QuantizedLinear` runs bfloat16 activations on one level without a dense copy, and on two beside
  one and for float32 activations, whose precision was asked for (`input_bits_for`). The embedded
  model's perplexity on the test passage (317 tokens, bfloat16, fed 4 tokens a step;
  ``benchmarks/kquant_embedded.py``, 2026-12-07, AMD EPYC): 20.98 on one level, 21.04 on two, 20.91
  dequantized; requantized to Q4_K_M 22.11 / 22.11 / 22.09, to Q6_K 21.39 / 21.35 / 21.27. One
  level is llama.cpp's accuracy, not two's: its greedy tokens part from the dequantized run's more
  often (at near-ties: 9 of 10 within 0.5 logit, one at 1.31; test_quantized_model.py), its logits
  up to 2.65 apart over 32 steps against 1.53 on two. The integer dots
  run on VPDPBUSD, the two levels' combined per group in int32 (so the float work is per input row); one
  pass over the weight serves up to 8 of a call's rows, and the weight stream is prefetched 8 KB
  ahead. Measured on a 2-core Intel Xeon with AMX, 2026-12-01 (``python benchmarks/quant_linears.py
  --threads 2``, weights cold; docs/benchmarks.md has the tables): at one row, the embedded model's
  120 layer linears take about half the time of torch's int4 kernel and a third to a half of the
  bfloat16 AMX kernel's, the tied 49152 x 576 int8 head half of torch's int8 kernel's. On two levels
  the layers beat the AMX copy up to 6 rows and are about even at 8, the head is even at 6 and loses
  up to ~1 ms at 8; `VNNI_MAX_ROWS` is 8, so a speculative verification of up to 7 drafts runs its
  linears on the kernel, each row bit-equal to a one-row step's. On a 2-core AMD EPYC (Zen 4, no
  AMX; 2026-12-07, ``python benchmarks/quant_linears.py --rows 32 512 --threads 2``) one level beats
  oneDNN's bfloat16 at every row count: the layers 20.4 against 25.6 ms at 32 rows, 242 against
  313 at 512 (two levels: 33.4 and 534).
- `TorchInt4Kernel` / `TorchInt8Kernel`, elsewhere: torch's ``_weight_int4pack_mm_for_cpu`` (its
  scale and zero in the activation dtype: in bfloat16 each group's scale rounded to 8 significant
  bits) and ``_weight_int8pack_mm`` (one scale per row: each row is requantized to the scale of its
  largest weight, ``s = max |w| / 127``, an absolute error of at most ``s / 2`` per weight).

The kernels read their weight once per call but do a fixed amount of work per input row, so against
a fast dense kernel (AMX) they win only for few rows; `QuantizedLinear` runs inputs of more rows on a
dense copy where the model keeps one (`dense_copies` keeps those that earn their memory on this CPU),
else on the VNNI kernel itself, else on a weight dequantized for that call. Every kernel gives back its weight dequantized to the
activation dtype (`dense_weight`) for that, so every row count computes with one set of weight
values (docs/backends.md#quantized-weights---weights).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

from stageserve.device.kernels import cpu_kernels, huge_pages
from stageserve.device.kernels.quant import (GROUP, SUPER, Int4Weight, Int5Weight, Int8Weight, KernelWeight, KQuantWeight, StackedWeight,
                                             format_name, is_symmetric, round_symmetric_int8, weight_shape)

LANES = 16  # output rows per panel of the VNNI layout (one per int32 lane)
# the VNNI kernel's scale layouts (csrc/quant_linear.cpp `Scheme`): per group of 32 (d and m), Q4_K/Q5_K's,
# Q6_K's, per group of 32 d alone (m = -2^(bits - 1) d: Q4_0, Q5_0, Q8_0)
GROUP_SCALES, K_MIN_SCALES, K_SYMMETRIC_SCALES, GROUP_SYMMETRIC_SCALES = 0, 1, 2, 3
VNNI_MAX_ROWS = 8  # either input level, measured (docs/benchmarks.md): about where the AMX copy starts to win
INT4_ROW_BLOCK = 64  # torch's int4 CPU kernel packs rows in blocks of 64 or 32 (`torch_int4_row_block`): N a multiple of 64 fits both
# torch's kernels (docs/benchmarks.md#quantized-weights: CPU time of a model's 120 linears on one thread,
# weights cold: int4 10.7 / 15.9 / 17.0 / 33.3 ms at 1 / 2 / 4 / 8 rows against 19.6 / 20.1 / 22.4 / 20.1 ms
# for the bfloat16 AMX kernel).
TORCH_MAX_ROWS = 4


def input_bits_for(dtype: torch.dtype, dense_copy: bool) -> int:
    """The VNNI kernel's ``input_bits`` for activations of ``dtype`` in a linear with or without a
    dense copy: two levels (16) beside a copy or in float32, else one (8) (module docstring: why)."""
    return 16 if dense_copy or dtype == torch.float32 else 8


def kernel_for(weight: KernelWeight, dtype: torch.dtype, input_bits: int,
               own_kernels: bool = True) -> VnniKernel | TorchInt4Kernel | TorchInt8Kernel | StackedKernel:
    """The fastest kernel this CPU has for ``weight`` with ``dtype`` activations (`VnniKernel` where
    it runs and ``own_kernels`` allows stageserve's CPU kernels, with ``input_bits``; torch's kernels
    take the activations as they are: int4, Q4_K as int4 (`as_int4`), and int8).

    Raises:
        ValueError: a weight only `VnniKernel` takes (int5, Q5_K, Q6_K) where it does not run (see `fits`).
    """
    if isinstance(weight, StackedWeight):
        return StackedKernel([kernel_for(p, dtype, input_bits, own_kernels) for p in weight.parts])
    if vnni_kernel_runs(own_kernels) and weight.q.shape[0] % LANES == 0:
        return VnniKernel(weight, dtype, input_bits)
    if isinstance(weight, Int8Weight):
        return TorchInt8Kernel(weight, dtype)
    int4 = as_int4(weight)
    if int4 is None:
        raise ValueError(f"torch's kernels take no {format_name(weight)} weight (see quant_linear.fits)")
    return TorchInt4Kernel(int4, dtype)


def fits(weight: KernelWeight, own_kernels: bool = True) -> bool:
    """Whether the kernel `kernel_for` picks takes ``weight`` ``[N, K]`` (K a multiple of 32, or of
    256 for a K-quant, by construction): `VnniKernel` needs N % 16 == 0; without it, torch's int4
    kernel (int4 and Q4_K) N % 64 == 0, torch's int8 any N, and int5, Q5_K and Q6_K have none; a
    `StackedWeight` where every part fits."""
    if isinstance(weight, StackedWeight):
        return all(fits(p, own_kernels) for p in weight.parts)
    n = weight.q.shape[0]
    if vnni_kernel_runs(own_kernels):
        return n % LANES == 0
    return isinstance(weight, Int8Weight) or (as_int4(weight) is not None and n % INT4_ROW_BLOCK == 0)


def as_int4(weight: KernelWeight) -> Int4Weight | None:
    """``weight`` as `Int4Weight` where it is one: int4, or Q4_K (``scale = d sc``, ``offset = -dmin m``
    per sub-block of 32, exact in float32); ``None`` for other formats."""
    if isinstance(weight, Int4Weight):
        return weight
    if isinstance(weight, KQuantWeight) and weight.bits == 4:
        per_group = SUPER // GROUP
        scale = weight.d.float().repeat_interleave(per_group, 1) * weight.sc.float()
        return Int4Weight(weight.q, scale, -(weight.dmin.float().repeat_interleave(per_group, 1) * weight.m.float()))
    return None


def vnni_kernel_runs(own_kernels: bool = True) -> bool:
    """Whether `kernel_for` picks `VnniKernel` here: stageserve's CPU kernels allowed (``own_kernels``)
    and loaded on a CPU with AVX512-VNNI."""
    return own_kernels and cpu_kernels.has_avx512_vnni()


class VnniKernel:
    """4- to 8-bit weights in 16-row panels for ``cpu_kernels.quant_linear`` (see the module docstring).

    ``packed`` uint8 ``[N / 16, K / 32, 64 * bits]``: int4/int5, Q4_K/Q5_K/Q6_K per group, 4 chunks
    of 64 bytes, byte ``4 i + j`` of chunk ``c`` = row ``i``'s input ``8 c + j`` in the low nibble,
    ``8 c + 4 + j`` in the high one (operands ``2 c`` and ``2 c + 1``), then for 5 and 6 bits one and
    two 64-byte planes of bit 4 and bit 5, bit ``t`` of plane byte ``b`` for operand ``t``'s byte
    ``b``; int8: 8 chunks, byte ``4 i + j`` of chunk ``c`` = ``q + 128`` of row ``i``'s input ``4 c + j``.
    ``scales`` (``GROUP_SCALES``, int4/int5) float16 ``[N / 16, K / 32, 2, 16]``: per panel and group
    the 16 rows' ``d``, then their ``m``, with ``w = d * q + m``; (``GROUP_SYMMETRIC_SCALES``, int8 and
    int4/int5 whose ``m`` is ``-2^(bits - 1) d``, as GGUF's Q4_0/Q5_0/Q8_0) float16 ``[N / 16, K / 32,
    16]``: ``d`` alone, ``w = d * (q - 2^(bits - 1))`` (int8: ``q + 128`` as packed); (``K_MIN_SCALES``,
    Q4_K/Q5_K) uint8 ``[N / 16, K / 256, 320]``: per panel and super-block the 16 rows' float16
    ``d``, then ``dmin``, then per group their ``sc``, then ``m``; (``K_SYMMETRIC_SCALES``, Q6_K) uint8 ``[N / 16,
    K / 256, 288]``: the 16 rows' float16 ``d``, then per 16 inputs their int8 ``sc``.

    Bits per weight against the GGUF file's: Q4_0 4.5 / 4.5, Q5_0 5.5 / 5.5, Q8_0 8.5 / 8.5, Q4_1 5 / 5,
    Q5_1 6 / 6, Q4_K 4.625 / 4.5, Q5_K 5.625 / 5.5, Q6_K 6.5625 / 6.5625 (the one-byte sub-block scales
    against ggml's 6-bit packing).
    """

    any_rows = True  # a bounded cost per further row (QuantizedLinear)
    max_rows = VNNI_MAX_ROWS

    def __init__(self, weight: KernelWeight, dtype: torch.dtype, input_bits: int) -> None:
        """Pack ``weight`` (N a multiple of 16); ``dtype`` is the activations' (bfloat16 or float32);
        ``input_bits`` 16 or 8: two or one int8 levels per input (``cpu_kernels.quant_linear``; the
        second doubles the integer work; `input_bits_for` chooses, `QuantizedLinear.hold_dense` sets it)."""
        self.dtype, self.input_bits = dtype, input_bits
        self.bits = {Int4Weight: 4, Int5Weight: 5, Int8Weight: 8}.get(type(weight)) or weight.bits
        self.qtype = weight.qtype if isinstance(weight, KQuantWeight) else None
        if self.qtype is not None:
            self.scheme = K_SYMMETRIC_SCALES if self.bits == 6 else K_MIN_SCALES
        elif is_symmetric(weight):
            self.scheme = GROUP_SYMMETRIC_SCALES
        else:
            self.scheme = GROUP_SCALES
        n, k = weight.q.shape
        panels, groups = n // LANES, k // GROUP
        if self.bits == 8:
            u = (weight.q.view(torch.uint8) ^ 0x80).view(panels, LANES, groups, 8, 4)  # q + 128 as unsigned bytes
            self.packed = u.permute(0, 2, 3, 1, 4).reshape(panels, groups, 512).contiguous()
        else:
            q = weight.q.view(panels, LANES, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)  # panel, group, chunk, nibble, row, input
            parts = [((q[:, :, :, 0] & 0x0F) | ((q[:, :, :, 1] & 0x0F) << 4)).reshape(panels, groups, 256)]
            operands = q.permute(0, 1, 4, 5, 2, 3).reshape(panels, groups, 64, 8)  # panel, group, byte 4 i + j, operand 2 c + h
            for bit in range(4, self.bits):
                parts.append((((operands >> bit) & 1) << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8))
            self.packed = torch.cat(parts, -1).contiguous()
        if self.scheme == GROUP_SCALES:
            d_m = torch.stack((weight.scale, weight.offset), -1).view(panels, LANES, groups, 2)
            self.scales = d_m.permute(0, 2, 3, 1).to(torch.float16).contiguous()
        elif self.scheme == GROUP_SYMMETRIC_SCALES:
            self.scales = weight.scale.view(panels, LANES, groups).permute(0, 2, 1).to(torch.float16).contiguous()
        else:
            supers = k // SUPER

            def lanes_last(t: torch.Tensor) -> torch.Tensor:  # [N, supers * j] -> uint8 [panels, supers, j * 16 * itemsize]
                t = t.view(panels, LANES, supers, -1).permute(0, 2, 3, 1).contiguous()
                return t.view(torch.uint8).reshape(panels, supers, -1)

            if self.scheme == K_MIN_SCALES:
                sub = torch.stack((weight.sc.view(n, supers, 8), weight.m.view(n, supers, 8)), -1).view(n, supers * 16)
                self.scales = torch.cat((lanes_last(weight.d), lanes_last(weight.dmin), lanes_last(sub)), -1).contiguous()
            else:
                self.scales = torch.cat((lanes_last(weight.d), lanes_last(weight.sc)), -1).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, K] of ``dtype`` -> ``x @ w.T`` [T, N]."""
        return cpu_kernels.quant_linear(x.contiguous(), self.packed, self.scales, self.bits, self.input_bits, self.scheme)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the kernel holds (for memory accounting)."""
        return [self.packed, self.scales]

    def _values(self) -> torch.Tensor:
        """The weight's integer values ``q`` uint8 ``[N, K]`` as packed (int8: ``q + 128``)."""
        panels, groups = self.packed.shape[:2]
        if self.bits == 8:
            q = self.packed.view(panels, groups, 8, LANES, 4).permute(0, 3, 1, 2, 4)  # panel, row, group, chunk, input
            return q.reshape(panels * LANES, groups * GROUP)
        chunks = self.packed[..., :256].view(panels, groups, 4, 1, LANES, 4)
        q = torch.cat((chunks & 0x0F, chunks >> 4), 3)  # panel, group, chunk, nibble, row, input
        for plane in range(self.bits - 4):
            bits = self.packed[..., 256 + 64 * plane : 320 + 64 * plane].view(panels, groups, LANES, 4, 1)
            bit = (bits >> torch.arange(8, dtype=torch.uint8)) & 1  # panel, group, row, input, operand 2 c + h
            q = q | (bit.view(panels, groups, LANES, 4, 4, 2).permute(0, 1, 4, 5, 2, 3) << (4 + plane))
        return q.permute(0, 4, 1, 2, 3, 5).reshape(panels * LANES, groups * GROUP)

    def _scales(self) -> tuple[torch.Tensor, ...]:
        """``GROUP_SCALES``, ``GROUP_SYMMETRIC_SCALES``: ``d``, ``m`` float32 ``[N, K / 32]``; ``K_MIN_SCALES``:
        ``d``, ``dmin`` float16 ``[N, K / 256]``, ``sc``, ``m`` uint8 ``[N, K / 32]``; ``K_SYMMETRIC_SCALES``: ``d``
        float16 ``[N, K / 256]``, ``sc`` int8 ``[N, K / 16]``."""
        panels, groups = self.packed.shape[:2]
        n = panels * LANES
        if self.scheme == GROUP_SCALES:
            return self.scales.float().permute(0, 3, 1, 2).reshape(n, groups, 2).unbind(-1)
        if self.scheme == GROUP_SYMMETRIC_SCALES:
            d = self.scales.float().permute(0, 2, 1).reshape(n, groups)
            return d, -(2 ** (self.bits - 1)) * d
        supers = groups * GROUP // SUPER

        def rows_first(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # uint8 [panels, supers, j * 16 * itemsize] -> [N, supers * j]
            return t.contiguous().view(dtype).view(panels, supers, -1, LANES).permute(0, 3, 1, 2).reshape(n, -1)

        if self.scheme == K_MIN_SCALES:
            sub = rows_first(self.scales[..., 64:], torch.uint8).view(n, supers, 8, 2)
            return (rows_first(self.scales[..., :32], torch.float16), rows_first(self.scales[..., 32:64], torch.float16),
                    sub[..., 0].reshape(n, -1), sub[..., 1].reshape(n, -1))
        return rows_first(self.scales[..., :32], torch.float16), rows_first(self.scales[..., 32:], torch.int8)

    def dense_weight(self) -> torch.Tensor:
        """The weight as ``dtype`` ``[N, K]``: ``d * q + m`` (K-quants: `KQuantWeight.dequantize`) in float32, rounded once."""
        q = self._values()
        n, k = q.shape
        if self.scheme in (GROUP_SCALES, GROUP_SYMMETRIC_SCALES):
            d, m = self._scales()
            return torch.addcmul(m[..., None], q.view(n, -1, GROUP).float(), d[..., None]).view(n, k).to(self.dtype)
        if self.scheme == K_MIN_SCALES:
            d, dmin, sc, m = self._scales()
        else:
            (d, sc), dmin = self._scales(), torch.empty(n, 0, dtype=torch.float16)
            m = torch.empty(n, 0, dtype=torch.uint8)
        return KQuantWeight(self.qtype, q, d, sc, dmin, m).dequantize().to(self.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] int64 of an int8 weight, dequantized: [T, K] of ``dtype`` (a tied embedding table;
        `cpu_kernels.quant_rows`, one op)."""
        return cpu_kernels.quant_rows(self.packed, self.scales, ids, self.dtype)


class StackedKernel:
    """The kernels of a `quant.StackedWeight`'s row ranges, their outputs side by side; each row's result
    is still independent of the other input rows."""

    def __init__(self, kernels: list[VnniKernel | TorchInt4Kernel | TorchInt8Kernel]) -> None:
        self.kernels = kernels
        self.dtype = kernels[0].dtype
        self.max_rows = min(k.max_rows for k in kernels)
        self.any_rows = all(k.any_rows for k in kernels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, K] of ``dtype`` -> [T, N]."""
        return torch.cat([k(x) for k in self.kernels], -1)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the kernels hold (for memory accounting)."""
        return [t for k in self.kernels for t in k.tensors()]

    def dense_weight(self) -> torch.Tensor:
        """The weight as ``dtype`` ``[N, K]``, each range from its kernel."""
        return torch.cat([k.dense_weight() for k in self.kernels])


@functools.cache
def torch_int4_row_block() -> int:
    """Rows per block of torch's int4 CPU packing (``_convert_weight_to_int4pack_for_cpu``): B = 64 in
    its AVX-512 build, 32 in its AVX2 one (ATen's ``int4mm_kernel.cpp`` packs by the CPU it runs on).
    The packed weight is ``[N / B, K, B / 2]`` bytes, byte ``d`` of a block's column holding row ``d``
    in its low nibble and row ``B / 2 + d`` in its high one; a probe whose row r holds ``r // 16``
    tells which: the first byte's high nibble is row 32's 2 (B = 64) or row 16's 1 (B = 32)."""
    probe = (torch.arange(64, dtype=torch.int32) // 16)[:, None].expand(64, GROUP).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    return {2: 64, 1: 32}[int(packed.flatten()[0]) >> 4]


class TorchInt4Kernel:
    """int4 weights for ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (N a multiple of 64): ``packed``
    uint8 ``[N / B, K, B / 2]`` as torch packs it (B: `torch_int4_row_block`), ``scale`` ``[K / 32, N, 2]``
    (scale, zero) in ``dtype``."""

    max_rows = TORCH_MAX_ROWS
    any_rows = False  # it dequantizes the weight for every row (QuantizedLinear)

    def __init__(self, weight: Int4Weight, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32), 1)
        zero = weight.offset + 8 * weight.scale  # the kernel computes (q - 8) * scale + zero
        self.scale = torch.stack((weight.scale.t(), zero.t()), -1).to(dtype).contiguous()
        self.out_features, self.in_features = weight.q.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, K] of ``dtype`` -> [T, N]."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, GROUP, self.scale)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the kernel holds (for memory accounting)."""
        return [self.packed, self.scale]

    def dense_weight(self) -> torch.Tensor:
        """The weight as the kernel computes it, ``(q - 8) * scale + zero`` in ``dtype`` ``[N, K]``."""
        n, k, rows = self.out_features, self.in_features, torch_int4_row_block()
        blocks, groups = n // rows, k // GROUP
        b = self.packed.view(blocks, k, rows // 2)
        q = torch.cat((b & 0x0F, b >> 4), 2).to(self.dtype).view(blocks, groups, GROUP, rows)  # row r of a block is the last index
        sz = self.scale.view(groups, blocks, 1, rows, 2).transpose(0, 1)  # [N / B, K / 32, 1, B, 2]
        w = torch.addcmul(sz[..., 1], q - 8, sz[..., 0])  # [N / B, K / 32, 32, B], rounded once to dtype
        return w.permute(0, 3, 1, 2).reshape(n, k)


class TorchInt8Kernel:
    """int8 weights for ``torch.ops.aten._weight_int8pack_mm``: ``q`` int8 ``[N, K]`` requantized to
    one scale per row, ``scale`` ``[N]`` in ``dtype`` (see the module docstring)."""

    max_rows = TORCH_MAX_ROWS
    any_rows = False  # it dequantizes the weight for every row (QuantizedLinear)

    def __init__(self, weight: Int8Weight, dtype: torch.dtype) -> None:
        self.dtype = dtype
        n, k = weight.q.shape
        w = (weight.q.float().view(n, k // GROUP, GROUP) * weight.scale[..., None]).view(n, k)
        self.q, scale = round_symmetric_int8(w)
        self.scale = scale.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, K] of ``dtype`` -> [T, N]."""
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.q, self.scale)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the kernel holds (for memory accounting)."""
        return [self.q, self.scale]

    def dense_weight(self) -> torch.Tensor:
        """The weight as the kernel computes it, ``q * scale`` in ``dtype`` ``[N, K]``."""
        return self.q.to(self.dtype) * self.scale[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] int64, dequantized: [T, K] of ``dtype`` (a tied embedding table)."""
        return self.q[ids].to(self.dtype) * self.scale[ids, None]


class QuantizedLinear:
    """``y = x @ w.T + bias`` with ``w`` held quantized (`quant.KernelWeight`) on the fastest kernel this CPU has (`kernel_for`).

    Inputs of at most the kernel's ``max_rows`` rows (measured, above) run on it. Larger ones run on
    a dense copy where the linear keeps one (`keep_dense_copy`; `dense_copies` chooses which do),
    else on the kernel itself where it takes any row count at a bounded cost per row (``VnniKernel``:
    each further row costs its integer work; on one input level less than a dense bfloat16 linear's
    on an AMD EPYC without AMX), else on a weight dequantized for that call (torch's kernels
    dequantize the weight for every row, so a call of many rows pays that once instead). The dense
    weight is the kernel's own values (`dense_weight`). The VNNI kernel takes bfloat16 activations
    on one input level without a dense copy and on two beside one (`input_bits_for`, `hold_dense`).
    """

    def __init__(self, weight: KernelWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 make_dense: Callable[[torch.Tensor], Any] | None = None, input_bits: int | None = None, own_kernels: bool = True) -> None:
        """``weight`` in a format `fits` takes, ``bias`` [N] of ``dtype`` or ``None``; ``dtype`` is the
        activations'. ``make_dense``: builds the dense linear (e.g. ``model.linear.Linear``) from the
        dequantized weight [N, K] when `keep_dense_copy` asks for one. ``input_bits``: the VNNI
        kernel's (`VnniKernel`) whether or not a dense copy is held; ``None``: as `hold_dense` sets them;
        ``own_kernels=False``: torch's kernels even where the VNNI one runs (``--no-cpu-kernels``).

        Raises:
            ValueError: a weight no kernel here takes (see `fits`).
        """
        if not fits(weight, own_kernels):
            raise ValueError(f"no quantized kernel on this CPU takes a {format_name(weight)} weight of {weight_shape(weight)[0]} rows (see quant_linear.fits)")
        self.format = format_name(weight)  # quant.format_name: int4, int5, int8, q4_k, q5_k or q6_k
        self.bias = bias
        self._fixed_input_bits = input_bits
        self.kernel = kernel_for(weight, dtype, input_bits or input_bits_for(dtype, dense_copy=False), own_kernels)
        self.shape: tuple[int, int] = weight_shape(weight)  # [N, K]
        self._make_dense = make_dense
        self.dense = None

    def keep_dense_copy(self) -> None:
        """Build the dense copy that inputs of more than the kernel's ``max_rows`` rows then run on.

        Raises:
            ValueError: the linear was built without ``make_dense``.
        """
        if self._make_dense is None:
            raise ValueError("this QuantizedLinear was built without make_dense: it cannot keep a dense copy")
        if self.dense is None:
            self.hold_dense(self._make_dense(self.kernel.dense_weight()))

    def hold_dense(self, dense: Any | None) -> None:
        """Run inputs of more than the kernel's ``max_rows`` rows on ``dense`` (the copy `keep_dense_copy`
        built; ``None``: on the kernel, the copy dropped), with the VNNI kernel's input levels to match
        (`input_bits_for`, unless fixed at construction): in bfloat16, one where the kernel runs every
        row count, two where its few-row results must round within bfloat16's rounding of the copy's."""
        self.dense = dense
        bits = self._fixed_input_bits or input_bits_for(self.dtype, dense is not None)
        for kernel in self.kernel_parts():
            if isinstance(kernel, VnniKernel):
                kernel.input_bits = bits

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the kernel's)."""
        return self.kernel.dtype

    def dense_copy_bytes(self) -> int:
        """Bytes a dense copy holds (``N * K`` in the activation dtype; packing pads little)."""
        return self.shape[0] * self.shape[1] * self.dtype.itemsize

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this linear holds (for memory accounting)."""
        return self.kernel.tensors() + ([self.bias] if self.bias is not None else []) + (self.dense.tensors() if self.dense is not None else [])

    def kernel_parts(self) -> list[VnniKernel | TorchInt4Kernel | TorchInt8Kernel]:
        """The kernel, or a stacked weight's kernels in row order."""
        return self.kernel.kernels if isinstance(self.kernel, StackedKernel) else [self.kernel]

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [T] int64 of an int8 weight, dequantized: [T, in] of ``dtype`` (a tied embedding table)."""
        return self.kernel.rows(ids)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, in] of ``dtype`` -> [T, out]."""
        if x.shape[0] > self.kernel.max_rows:
            if self.dense is not None:
                return self.dense(x)
            if not self.kernel.any_rows:
                return F.linear(x, self.dense_weight(), self.bias)
        y = self.kernel(x)
        return y if self.bias is None else y + self.bias

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this ``[gate; up]`` projection of ``x`` [T, in] -> [T, out / 2] (CPU kernels)."""
        if x.shape[0] > self.kernel.max_rows and self.dense is not None:
            return self.dense.swiglu(x)
        return cpu_kernels.silu_and_mul(self(x))

    def dense_weight(self) -> torch.Tensor:
        """The weight dequantized to ``dtype`` ``[N, K]``, from the kernel's copy (no other copy is kept)."""
        return self.kernel.dense_weight()


def vnni_kernels(linears: Iterable[object]) -> list[VnniKernel]:
    """The `VnniKernel` parts of the `QuantizedLinear` objects among ``linears`` (others are skipped), in order."""
    return [k for lin in linears if isinstance(lin, QuantizedLinear) for k in lin.kernel_parts() if isinstance(k, VnniKernel)]


def move_onto_huge_pages(linears: Iterable[object]) -> int:
    """Move the weights of ``linears``' `vnni_kernels` into one memory map on transparent huge pages,
    in the order given (`huge_pages.onto_huge_pages`: why), so that a decode step streams them as one
    region; returns the bytes moved."""
    kernels = vnni_kernels(linears)
    copies = iter(huge_pages.onto_huge_pages([t for k in kernels for t in (k.packed, k.scales)]))
    for kernel in kernels:
        kernel.packed, kernel.scales = next(copies), next(copies)
    return sum(k.packed.nbytes + k.scales.nbytes for k in kernels)
