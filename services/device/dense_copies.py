"""Which quantized linears also keep a dense copy: timed on the CPU at hand, within a memory budget.

A `QuantizedLinear` runs inputs of up to its kernel's ``max_rows`` rows on the kernel; larger ones
(decode steps of many streams, prefill chunks) on a dense copy where it keeps one. A copy costs a
dense weight's memory and earns it only where the dense linear runs such inputs faster than the
kernel, which depends on the CPU: with AMX the dense bfloat16 copy is several times faster at 32
rows; without it (an AMD EPYC) the VNNI kernel is about even with oneDNN's bfloat16 at 16 rows and
1.1-2x slower at 32, by shape. So `choose` times, for one linear of each shape and format, both on
an input of ``rows`` rows (interleaved, median of ``REPEATS``) and keeps copies in order of the time
they save per byte, while their bytes fit ``budget_bytes`` (the model passes what keeps its weights
within one dense copy of the model: quantized weights never hold more than the dequantized model).
The choice changes which linear runs a many-row input, never a row's values beyond the dense copy's
own rounding (it holds the kernel's weight values, `QuantizedLinear.dense_weight`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stageserve.device.quant_linear import QuantizedLinear

log = logging.getLogger(__name__)

ROWS = 32  # rows of the timed input: a decode step of 32 streams
REPEATS = 5


@dataclass
class ShapeTiming:
    """One shape and format's linears and what a dense copy saves each of them on ``ROWS`` rows."""

    linears: list[QuantizedLinear]
    kernel_ms: float
    dense_ms: float

    @property
    def saved_ms_per_byte(self) -> float:
        return (self.kernel_ms - self.dense_ms) / self.linears[0].dense_copy_bytes()

    def describe(self, kept: int) -> str:
        n, k = self.linears[0].shape
        fmt = "int4" if self.linears[0].int4 else "int8"
        return f"{kept} of {len(self.linears)} {n}x{k} {fmt} ({self.kernel_ms:.2f} ms on the kernel, {self.dense_ms:.2f} ms dense)"


def time_on_kernel_and_dense(linear: QuantizedLinear, rows: int, repeats: int = REPEATS) -> tuple[float, float]:
    """Median wall ms of ``linear`` on a random ``rows``-row input without and with a dense copy
    (built for this and dropped again), ``repeats`` calls each, interleaved after one warm-up call each."""
    x = torch.randn(rows, linear.shape[1], dtype=linear.dtype)
    linear.keep_dense_copy()
    dense, calls = linear.dense, ([], [])
    try:
        for i in range(repeats + 1):
            for copy, times in ((None, calls[0]), (dense, calls[1])):
                linear.dense = copy
                start = time.perf_counter()
                linear(x)
                if i:
                    times.append(time.perf_counter() - start)
    finally:
        linear.dense = None
    return statistics.median(calls[0]) * 1e3, statistics.median(calls[1]) * 1e3


def choose(linears: Sequence[QuantizedLinear], budget_bytes: int, rows: int = ROWS,
           timer: Callable[[QuantizedLinear, int], tuple[float, float]] = time_on_kernel_and_dense) -> int:
    """Give dense copies to those of ``linears`` where they save the most time per byte, while their
    bytes stay within ``budget_bytes``; log the choice per shape; return the bytes the copies hold.

    ``timer(linear, rows)`` -> ms on the kernel and on a dense copy (`time_on_kernel_and_dense`; a
    test passes its own). A shape whose copy saves no time gets none, whatever the budget.
    """
    by_shape: dict[tuple, list[QuantizedLinear]] = {}
    for linear in linears:
        by_shape.setdefault((linear.shape, linear.int4, linear.bias is not None), []).append(linear)
    timings = sorted((ShapeTiming(group, *timer(group[0], rows)) for group in by_shape.values()), key=lambda t: -t.saved_ms_per_byte)
    used, lines = 0, []
    for timing in timings:
        kept = 0
        for linear in timing.linears:
            if timing.kernel_ms > timing.dense_ms and used + linear.dense_copy_bytes() <= budget_bytes:
                linear.keep_dense_copy()
                used += linear.dense_copy_bytes()
                kept += 1
        lines.append(timing.describe(kept))
    log.info("dense copies for inputs of more rows than the quantized kernels take, timed at %d rows, within %.1f MiB: %s; they hold %.1f MiB",
             rows, budget_bytes / 2**20, "; ".join(lines), used / 2**20)
    return used
