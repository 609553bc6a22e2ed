"""Which quantized linears also keep a dense copy: timed on the CPU at hand, within a memory budget.

A `QuantizedLinear` runs inputs of up to its kernel's ``max_rows`` rows on the kernel; larger ones
(decode steps of many streams, prefill chunks) on a dense copy where it keeps one. A copy costs a
dense weight's memory and earns it only where the dense linear runs such inputs faster than the
kernel, which depends on the CPU: with AMX the dense bfloat16 copy is several times faster at 32
rows; without it (an AMD EPYC) the VNNI kernel, on the one input level it takes without a copy
(`QuantizedLinear.hold_dense`), is faster than oneDNN's bfloat16 at every row count (on two it was
1.1-2x slower at 32 rows). So `choose` times, for one linear of each shape and format, both
on an input of ``rows`` rows (one thread's CPU time, interleaved, the least of ``REPEATS``) and
keeps copies where the dense linear takes at most ``1 - MIN_SAVING`` of the kernel's time, in order
of the time they save per byte, while their bytes fit ``budget_bytes`` (the
model passes what keeps its weights within one dense copy of the model: quantized weights never
hold more than the dequantized model). The choice changes which linear runs a many-row input and
the kernel's input levels, never a row's values beyond the dense copy's own rounding (it holds the
kernel's weight values, `QuantizedLinear.dense_weight`) or the kernel's input rounding. So that every
process on one machine makes the same choice (a request's greedy tokens must not depend on which of
two devices, or which restart, served it), the first process to time a set of shapes writes the
timings to ``$XDG_CACHE_HOME/stageserve/dense-copies/`` (default ``~/.cache``), keyed by the CPU
model, torch's version, the dtype, the kernels' input levels and the shapes, and later ones read them; delete the folder to
time again. Where the cache cannot be written (a read-only disk), each process times.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from stageserve.cache_dirs import user_cache_dir
from stageserve.device.kernels.quant_linear import QuantizedLinear, vnni_kernels

log = logging.getLogger(__name__)

ROWS = 32  # rows of the timed input: a decode step of 32 streams
REPEATS = 7
# A copy also costs more than its memory: beside it the kernel takes two input levels, and a model with
# any copy runs decode steps of more rows than the kernel takes op by op, not as one call
# (model/fused_decode.py). A shape whose copy saves less than this share of the kernel's time is a
# tie, and a tie keeps none: Q4_K_M's Q6_K down projections on an AMD EPYC (0.269 ms dense, 0.274 on
# the kernel) kept 14 copies, and their model's 32-row step took 1.09x the time it takes without.
MIN_SAVING = 0.1


@dataclass
class ShapeTiming:
    """One shape and format's linears and what a dense copy saves each of them on ``ROWS`` rows."""

    linears: list[QuantizedLinear]
    kernel_ms: float
    dense_ms: float

    @property
    def saved_ms_per_byte(self) -> float:
        """Milliseconds a call on ``ROWS`` rows saves per byte of dense copy (negative: the copy is slower)."""
        return (self.kernel_ms - self.dense_ms) / self.linears[0].dense_copy_bytes()

    def describe(self, kept: int) -> str:
        """One shape's part of the log line: how many of its linears keep a copy, and the two timings."""
        n, k = self.linears[0].shape
        return f"{kept} of {len(self.linears)} {n}x{k} {self.linears[0].format} ({self.kernel_ms:.2f} ms on the kernel, {self.dense_ms:.2f} ms dense)"


def time_on_kernel_and_dense(linear: QuantizedLinear, rows: int, repeats: int = REPEATS) -> tuple[float, float]:
    """CPU ms of ``linear`` on a random ``rows``-row input without and with a dense copy (built for
    this and dropped again; each side with the kernel's input levels it would run with,
    `QuantizedLinear.hold_dense`): the least of ``repeats`` calls each, interleaved after one warm-up call each.

    Timed on one thread, in the calling thread's CPU time, so that other work on the machine (a
    second device starting, a busy CI runner) does not decide the choice: it only adds wall time
    (the least, not the median, drops what it still adds through the caches).
    """
    x = torch.randn(rows, linear.shape[1], dtype=linear.dtype)
    linear.keep_dense_copy()
    dense, calls = linear.dense, ([], [])
    # A SwiGLU [gate; up] linear is timed as the model runs it, through swiglu (its AMX-only copy has no plain product).
    run = linear.swiglu if getattr(dense, "gated", False) else linear
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(repeats + 1):
            for copy, times in ((None, calls[0]), (dense, calls[1])):
                linear.hold_dense(copy)
                start = time.thread_time()
                run(x)
                if i:
                    times.append(time.thread_time() - start)
    finally:
        linear.hold_dense(None)
        torch.set_num_threads(threads)
    return min(calls[0]) * 1e3, min(calls[1]) * 1e3


def cache_path(linears: Sequence[QuantizedLinear], rows: int) -> Path:
    """Where the timings of ``linears``' shapes on this machine are cached (see the module docstring)."""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = "unknown cpu"
    keys = sorted({_shape_key(linear) for linear in linears})
    input_bits = sorted({kernel.input_bits for kernel in vnni_kernels(linears)})
    digest = hashlib.sha256(json.dumps([cpu, torch.__version__, str(linears[0].dtype), rows, keys, input_bits]).encode())
    return user_cache_dir("dense-copies") / f"{digest.hexdigest()[:16]}.json"


def _shape_key(linear: QuantizedLinear) -> str:
    n, k = linear.shape
    return f"{n}x{k} {linear.format}{' bias' if linear.bias is not None else ''}"


def _read_timings(path: Path, keys: set[str]) -> dict[str, list[float]] | None:
    """The timings cached at ``path`` if they cover exactly ``keys``, else ``None``."""
    try:
        timed = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return timed if isinstance(timed, dict) and set(timed) == keys else None


def _share_timings(measured: dict[str, list[float]], path: Path) -> tuple[dict[str, list[float]], str]:
    """Write ``measured`` to ``path`` unless another process wrote it first (then its timings are
    used); the timings and where they came from."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(json.dumps(measured))
        try:
            os.link(staged, path)  # atomic and exclusive: the first writer's timings are everyone's
            return measured, f"timed at start-up, cached in {path}"
        except FileExistsError:
            earlier = _read_timings(path, set(measured))
            return (earlier, f"as timed earlier on this machine ({path})") if earlier else (measured, "timed at start-up")
        finally:
            staged.unlink()
    except OSError as exc:
        log.warning("dense-copy timings not shared through %s (%s): this process's own are used", path, exc)
        return measured, "timed at start-up"


def choose(linears: Sequence[QuantizedLinear], budget_bytes: int, rows: int = ROWS,
           timer: Callable[[QuantizedLinear, int], tuple[float, float]] = time_on_kernel_and_dense, cache: Path | None = None) -> int:
    """Give dense copies to those of ``linears`` where they save the most time per byte, while their
    bytes stay within ``budget_bytes``; log the choice per shape; return the bytes the copies hold.

    ``timer(linear, rows)`` -> ms on the kernel and on a dense copy (`time_on_kernel_and_dense`; a
    test passes its own). ``cache``: a file (`cache_path`) holding the timings of these shapes, read
    when present, else written (``None``: time, and share nothing). A shape whose copy saves less
    than ``MIN_SAVING`` of the kernel's time gets none, whatever the budget.
    """
    by_shape: dict[str, list[QuantizedLinear]] = {}
    for linear in linears:
        by_shape.setdefault(_shape_key(linear), []).append(linear)
    timed = _read_timings(cache, set(by_shape)) if cache is not None else None
    source = f"as timed earlier on this machine ({cache})"
    if timed is None:
        timed = {key: list(timer(group[0], rows)) for key, group in by_shape.items()}
        timed, source = _share_timings(timed, cache) if cache is not None else (timed, "timed at start-up")
    timings = sorted((ShapeTiming(by_shape[key], *timed[key]) for key in by_shape), key=lambda t: -t.saved_ms_per_byte)
    used, lines = 0, []
    for timing in timings:
        kept = 0
        for linear in timing.linears:
            if timing.dense_ms <= (1 - MIN_SAVING) * timing.kernel_ms and used + linear.dense_copy_bytes() <= budget_bytes:
                linear.keep_dense_copy()
                used += linear.dense_copy_bytes()
                kept += 1
        lines.append(timing.describe(kept))
    log.info("dense copies for inputs of more rows than the quantized kernels take, %d-row timings %s, within %.1f MiB: %s; they hold %.1f MiB",
             rows, source, budget_bytes / 2**20, "; ".join(lines), used / 2**20)
    return used
