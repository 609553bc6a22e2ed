"""Fused C++ kernels for the CPU backend, compiled on first use and cached on disk.

On an x86-64 CPU with AVX-512 the decode step's small operations are fused, as vLLM's CPU backend
does: paged decode attention reading the KV pool in place, RoPE plus the KV store, residual add
plus RMSNorm, SwiGLU, greedy argmax over bf16 logits, structured output's token bitmask. On CPUs
with AMX-BF16 the bf16 linears of a decode step run on AMX tiles (``amx_linear``, ``amx_swiglu``; ``amx_ready`` says where). On a CPU
without AVX-512 (or another dtype or head shape) the model keeps its pure-torch path; ``available``
says which.

The sources (``csrc/``) register ``torch.ops.stageserve.*`` ops. They are compiled with torch's
own extension builder (``torch.utils.cpp_extension.load``: the C++ compiler, torch's headers and
flags, ninja) into ``$STAGESERVE_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/stageserve/kernels``, ``~/.cache`` without it), in a
folder named by a hash of the sources, the torch version, the machine type and the flags, so a new
torch or an edited source builds afresh. Each build runs in its own temporary
folder and the finished library is renamed into place, so processes starting together never wait
on a lock (a build takes ~20 s on a 2-core CPU). Where no compiler is available the build fails, the
failure is logged once, and the model keeps its pure-torch path; ``unavailable_reason`` says why.
The test suite does not take that fallback on an AVX-512 CPU: ``tests/unit/device/test_cpu_kernels.py``
fails there unless the kernels load and a model step runs through them.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

from stageserve.cache_dirs import user_cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
LIBRARY_NAME = "stageserve_cpu_kernels"
CFLAGS = ["-O3", "-fopenmp"]  # -fopenmp: at::parallel_for runs on torch's OpenMP pool


def cache_dir() -> Path:
    """Where built kernel libraries live (``$STAGESERVE_KERNEL_CACHE``, else ``user_cache_dir("kernels")``:
    ``$XDG_CACHE_HOME/stageserve/kernels``, ``~/.cache`` by default)."""
    configured = os.environ.get("STAGESERVE_KERNEL_CACHE")
    return Path(configured) if configured else user_cache_dir("kernels")


def library_path() -> Path:
    """The cached library for these sources, torch version, machine type and flags (it may not be built yet)."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(torch.__version__.encode() + platform.machine().encode() + " ".join(CFLAGS).encode())
    return cache_dir() / digest.hexdigest()[:16] / f"{LIBRARY_NAME}.so"


def build(target: Path) -> None:
    """Compile the kernels into ``target`` (atomically) and load them into this process.

    Raises ``RuntimeError`` naming the compiler when torch's (``$CXX``, else ``c++``) is not on PATH,
    else whatever the compiler step raises.
    """
    from torch.utils.cpp_extension import get_cxx_compiler, load  # imported only to build: they pull in setuptools

    if shutil.which(get_cxx_compiler()) is None:  # torch's own error would only say "ninja: build stopped"
        raise RuntimeError(f"no C++ compiler: {get_cxx_compiler()!r} is not on PATH (install g++, or set CXX)")
    # torch runs `ninja` from PATH; the `ninja` dependency puts it next to this interpreter, which is
    # not on PATH when a service is started by its full path without activating the environment.
    scripts = sysconfig.get_path("scripts")
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
    try:
        load(LIBRARY_NAME, [str(p) for p in SOURCES], extra_cflags=CFLAGS, extra_include_paths=[str(CSRC)], build_directory=str(work), is_python_module=False, verbose=False)
        # load() has already loaded the library from `work` into this process: it must not be loaded
        # again (its ops would register twice). Another process building at the same time may
        # replace `target` with its own copy; either copy is the same build.
        os.replace(work / f"{LIBRARY_NAME}.so", target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


_load_lock = threading.Lock()


@functools.cache
def _load() -> str | None:
    """Load the kernels, building them first if needed: ``None`` once loaded, else why not (logged)."""
    machine, capability = platform.machine(), torch.backends.cpu.get_cpu_capability()
    if machine.lower() not in ("x86_64", "amd64") or capability != "AVX512":
        reason = f"they need an x86-64 CPU with AVX-512 (this is {machine}, torch's CPU capability {capability})"
        logger.info("CPU kernels not built: %s; the model runs plain torch ops", reason)
        return reason
    target = library_path()
    try:
        if target.exists():
            torch.ops.load_library(str(target))
        else:
            logger.info("building the CPU kernels into %s", target.parent)
            build(target)  # loads the library it builds
        return None
    except Exception as error:  # no compiler, no ninja, a read-only cache: the torch path still works
        lines = str(error).strip().splitlines() or [type(error).__name__]
        reason = next((line for line in lines if "error:" in line), lines[-1]).strip()  # the compiler's first error, if any
        logger.warning("CPU kernels unavailable, the model keeps its pure-torch path: %s", reason)
        return reason


def unavailable_reason() -> str | None:
    """Why the kernels are not loaded in this process (the CPU, or the build's first error), ``None``
    once they are; tries to load them first, as ``load_cpu_kernels``."""
    with _load_lock:  # two threads' first calls must not build into the same process twice
        return _load()


def load_cpu_kernels() -> bool:
    """Build if needed and load the kernels into ``torch.ops.stageserve``, once per process; ``False``
    (logged; ``unavailable_reason`` says why) on a CPU without AVX-512 (nothing is built there) or
    where the build fails."""
    return unavailable_reason() is None


def available(dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether every op here runs ``dtype`` with this head size and query heads per kv head on this CPU."""
    return load_cpu_kernels() and torch.ops.stageserve.supported(dtype, head_dim, group)


def paged_decode_attention(
    q: torch.Tensor, kv: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Single-query attention of each row over its paged context, read in place from the KV pool.

    Args:
        q: ``[B, H, D]`` bfloat16 or float32, ``D`` contiguous (RoPE already applied).
        kv: one layer's pool ``[2 * K, num_blocks, block_size, D]`` contiguous, K heads then V heads
            (``PagedKVCache.layer``), same dtype as ``q``.
        block_tables: ``[B, W]`` int64 contiguous, each row's blocks in order (padding beyond its context unused).
        context_lens: ``[B]`` int64 contiguous, tokens each row attends to (its position + 1), ``1 <= len <= W * block_size``.
        scale: the softmax scale, usually ``head_dim ** -0.5``.
        window: a sliding window: each row attends only to its last ``window`` tokens (the blocks
            before are not read, so they may be stale); ``None`` for the whole context.
        softcap: each scaled score s becomes ``softcap * tanh(s / softcap)`` before the softmax
            (Gemma 2's ``attn_logit_softcapping``); ``None`` for none.

    Returns:
        ``[B, H * D]`` in ``q``'s dtype; fp32 scores, exact softmax and fp32 accumulation inside.

    Raises:
        RuntimeError: shapes, dtypes or bounds that do not fit, or no kernel for them on this CPU
            (check ``available`` first). So do the other ops here.
    """
    return torch.ops.stageserve.paged_decode_attention(q, kv, block_tables, context_lens, scale, window or 0, softcap or 0.0)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int) -> torch.Tensor:
    """RoPE on the q and k heads of ``qkv`` and the new keys and values stored into the KV pool.

    ``qkv`` ``[T, (H + 2K) * D]`` (rows contiguous); ``cos``/``signed_sin`` ``[positions, D]``
    (``rope.rope_tables``); ``positions`` and ``slot_mapping`` ``[T]`` int64; ``kv`` one layer's
    pool ``[2K, num_blocks, block_size, D]``, written at ``slot_mapping``. Returns the rotated q and k
    heads ``[T, H + K, D]``. fp32 inside, rounded once. Raises ``RuntimeError`` for shapes or dtypes
    that do not fit, or a position or slot outside the tables, before anything is written.
    """
    return torch.ops.stageserve.rope_and_cache(qkv, cos, signed_sin, positions, kv, slot_mapping, num_heads)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[T, hidden]`` (contiguous) times ``weight`` ``[hidden]``, fp32 inside -> new ``[T, hidden]``.

    Raises ``RuntimeError`` for another layout or dtype (bfloat16 and float32 only), as do the ops below.
    """
    return torch.ops.stageserve.rms_norm(x, weight, eps)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += delta`` in place (rounded to its dtype), then return ``rms_norm(residual, weight, eps)``; both ``[T, hidden]`` contiguous."""
    return torch.ops.stageserve.add_rms_norm(residual, delta, weight, eps)


def rms_norm_heads_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, heads: int, kv_heads: int, eps: float) -> None:
    """In place, RMSNorm each of the ``heads`` query heads of ``qkv`` ``[T, (heads + 2 * kv_heads) * D]``
    (contiguous) times ``q_weight`` ``[D]`` and each of its ``kv_heads`` key heads times ``k_weight``;
    values untouched (Qwen3's and Gemma 3's ``q_norm`` / ``k_norm`` before RoPE), fp32 inside.

    Raises ``RuntimeError`` without AVX-512, for another layout or dtype, or weights of another
    length or dtype than the heads'."""
    torch.ops.stageserve.rms_norm_heads_(qkv, q_weight, k_weight, heads, kv_heads, eps)


def decode_layers(
    x: torch.Tensor, input_norms: list[torch.Tensor], post_norms: list[torch.Tensor], qk_norms: list[torch.Tensor],
    linear_tensors: list[torch.Tensor], linear_meta: list[int], moe_meta: list[int], routers: list[torch.Tensor], kv: torch.Tensor,
    cos: list[torch.Tensor], signed_sin: list[torch.Tensor], layer_rope: list[int], windows: list[int], positions: torch.Tensor,
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, heads: int, kv_heads: int, scale: float, softcap: float, eps: float,
) -> None:
    """A decode-only step's decoder layers in one call (`model.fused_decode`, which flattens them):
    `rms_norm` of ``x`` by ``input_norms[0]``, then per layer ``qkv`` (q/k head norms where ``qk_norms``
    holds two a layer), `rope_and_cache` into ``kv[layer]`` at ``positions`` and ``slot_mapping``,
    `paged_decode_attention` over ``block_tables`` up to each row's position (``windows``: 0 for the whole context), ``o``,
    `add_rms_norm` with ``post_norms``, the MLP (SwiGLU through ``gate_up`` and ``down``, or, where
    ``moe_meta`` gives the layer experts, a mixture of experts routed by the next of ``routers`` as
    `moe.KernelRouter` routes), `add_rms_norm` with the next layer's ``input_norms`` (the last adds
    into ``x``). ``x`` ``[T, hidden]``, the embeddings, is the residual, updated in place. Each linear, on `quant_linear`, and ``moe_meta`` (three ints a layer: experts,
    0 for a dense MLP; top k; normalized) are given as in ``csrc/decode_layers.cpp``. Raises
    ``RuntimeError`` for lists that do not fit, and as the ops it calls.
    """
    torch.ops.stageserve.decode_layers(x, input_norms, post_norms, qk_norms, linear_tensors, linear_meta, moe_meta, routers, kv, cos,
                                       signed_sin, layer_rope, windows, positions, slot_mapping, block_tables, heads, kv_heads, scale,
                                       softcap, eps)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A mixture of experts' router logits: ``x`` [T, hidden] (contiguous, bfloat16 or float32) times
    ``weight`` float32 [E, hidden] (contiguous) -> float32 [T, E], each dot summed in float32 in one
    fixed order (a row's logits do not depend on the other rows). Raises ``RuntimeError`` for other
    shapes or dtypes, or without AVX-512."""
    return torch.ops.stageserve.router_logits(x, weight)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` of ``gate_up`` ``[T, 2 * I]`` (contiguous, gate first) -> ``[T, I]``, fp32 inside."""
    return torch.ops.stageserve.silu_and_mul(gate_up)


AMX_MAX_ROWS = 64
"""Most rows ``amx_linear`` takes (a decode step's batch); larger inputs go to oneDNN."""


def amx_ready(weight: torch.Tensor, gated: bool = False) -> bool:
    """Whether ``weight`` ``[N, K]`` can run through ``amx_linear`` (``gated``: ``amx_swiglu``): the
    kernels loaded, a CPU with AMX-BF16 that the OS grants, a CPU bfloat16 weight with N a multiple
    of 16 (32 gated) and K of 32."""
    n, k = weight.shape
    return (
        weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and n % (32 if gated else 16) == 0 and k % 32 == 0
        and load_cpu_kernels() and torch.ops.stageserve.has_amx()
    )


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` bfloat16 -> ``[N / 16, K / 32, 16, 32]``: per 16 output columns and 32
    inputs, one AMX tile in the VNNI layout TDPBF16PS reads (row r = input pair r, each column's two
    values side by side), the tiles of 16 columns consecutive so a linear streams the weight once."""
    n, k = weight.shape
    return weight.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous().view(n // 16, k // 32, 16, 32)


def amx_pack_gated(weight: torch.Tensor) -> torch.Tensor:
    """SwiGLU's fused ``[gate; up]`` weight ``[2 * I, K]`` -> ``amx_pack`` of its 16-row blocks taken
    alternately from gate and up, so ``amx_swiglu`` finds each output block's two halves side by side."""
    two_i, k = weight.shape
    return amx_pack(weight.view(2, two_i // 32, 16, k).transpose(0, 1).reshape(two_i, k))


def amx_swiglu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` on AMX from ``packed = amx_pack_gated([gate; up])``: ``x``
    ``[M, K]`` as for ``amx_linear`` -> ``[M, I]`` bfloat16, both sums fp32, rounded once; the
    ``[M, 2 * I]`` projection is never written. Raises as ``amx_linear``."""
    return torch.ops.stageserve.amx_swiglu(x, packed)


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` on AMX: ``x`` ``[M, K]`` bfloat16 (rows contiguous, ``M <= AMX_MAX_ROWS``),
    ``packed = amx_pack(W)``, ``bias`` ``[N]`` bfloat16 or ``None`` -> ``[M, N]`` bfloat16 (fp32 sums, rounded once).

    A call costs 2.7 us from Python (1 x 64 x 64) where torch's packed oneDNN linear takes 16-22 us,
    and the weight streams with prefetching (a model's decode-step linears ~20 % faster on a 2-core
    Xeon). Raises ``RuntimeError`` for other shapes or dtypes, or without AMX (check ``amx_ready`` first).
    """
    return torch.ops.stageserve.amx_linear(x, packed, bias)


def has_avx512_vnni() -> bool:
    """Whether `quant_linear` runs here: the kernels loaded on a CPU with AVX512-VNNI."""
    return load_cpu_kernels() and torch.ops.stageserve.has_avx512_vnni()


def quant_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bits: int, input_bits: int = 8, scheme: int = 0) -> torch.Tensor:
    """``x @ W.T`` for a 4-, 5-, 6- or 8-bit weight in groups of 32 along K (``w = d * q + m`` per
    group, or ``d * (q - 2^(bits - 1))``, or llama.cpp's K-quant super-blocks of 256), ``x`` quantized
    per row to int8 groups of 32 inside (``input_bits=16``: plus a second int8 level for the first's rounding error,
    ``x ~ s (256 p + p')``, at twice the integer work), the dots on AVX512-VNNI. A row's result does
    not depend on the other rows of ``x``.

    ``x`` ``[M, K]`` bfloat16 or float32 contiguous; ``packed`` uint8 ``[N / 16, K / 32, 64 * bits]``
    and ``scales`` as ``quant_linear.VnniKernel`` lays them out for ``scheme`` (0: float16 ``[N / 16,
    K / 32, 2, 16]`` (d, m) for bits 4, 5, 8; 1, Q4_K/Q5_K: uint8 ``[N / 16, K / 256, 320]`` for bits 4, 5; 2,
    Q6_K: uint8 ``[N / 16, K / 256, 288]`` for bits 6; 3, symmetric: float16 ``[N / 16, K / 32, 16]`` (d)
    for bits 4, 5, 8) -> ``[M, N]`` in ``x``'s dtype (fp32 sums,
    rounded once). Raises ``RuntimeError`` for other shapes or dtypes, or without AVX512-VNNI.
    """
    return torch.ops.stageserve.quant_linear(x, packed, scales, bits, input_bits, scheme)


def quant_linear_segments(x: torch.Tensor, packed: list[torch.Tensor], scales: list[torch.Tensor], counts: list[int], bits: int,
                          input_bits: int = 8, scheme: int = 0) -> torch.Tensor:
    """`quant_linear` of consecutive row segments of ``x`` ``[M, K]``, each through its own weight (a
    mixture's experts over the rows routed to them, sorted by expert): the ``counts[i]`` rows after the
    previous segments' through ``packed[i]``, ``scales[i]``, every weight of the same format and shape
    -> ``[M, N]`` in ``x``'s dtype, each row bit for bit `quant_linear`'s of it alone. ``x`` is quantized
    once and every segment's panels run in one parallel region. Raises ``RuntimeError`` where the
    counts do not add up to M, or as `quant_linear` does.
    """
    return torch.ops.stageserve.quant_linear_segments(x, packed, scales, counts, bits, input_bits, scheme)


def quant_rows(packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` [T] int64 of an 8-bit weight in `quant_linear`'s layout (uint8 ``packed`` [N / 16, K / 32, 512],
    float16 ``scales`` [N / 16, K / 32, 2, 16] or [N / 16, K / 32, 16]), dequantized (``d * q`` in float32,
    rounded once): [T, K] of ``dtype`` (bfloat16 or float32). One op for a tied embedding table's lookup, where indexing the panels
    from Python takes ~14. Raises ``RuntimeError`` for an id outside the weight's rows, or other shapes."""
    return torch.ops.stageserve.quant_rows(packed, scales, ids, dtype)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index ``[S]`` int64 of each row's maximum in ``x`` ``[S, V]`` (bfloat16 or float32, rows contiguous),
    read in one pass in its own dtype; the first index on ties and the first NaN if any, as ``torch.max``."""
    return torch.ops.stageserve.argmax_rows(x)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, cutoff: torch.Tensor | None, seed: torch.Tensor,
                  step_index: torch.Tensor) -> torch.Tensor:
    """Random sampling's draw in one pass per row: index ``[S]`` int64 of the maximum of
    ``clamp(logits / temperature, +-float32 max)``, set to -inf below ``cutoff``, minus ``log(E)``
    for the sampler's counter-based Exp(1) noise of (``seed``, ``step_index``, token id) (the
    Gumbel-max trick, `sampler._log_exponential_noise`: the same bits and uniforms; the logs are
    the kernel's own, within an ulp or two of torch's). The first index on ties, the first NaN if any.

    ``logits`` ``[S, V]`` bfloat16 or float32, rows contiguous; ``temperature`` and ``cutoff``
    (``None``: none) ``[S]`` float32; ``seed`` and ``step_index`` ``[S]`` int64. [32, 49152]
    bfloat16 logits in 1.8 ms against 7.3 ms for the torch ops (scale, noise, argmax; 2-core Intel Xeon with AMX,
    2026-12-01, timed in a loop of 30 calls).
    """
    return torch.ops.stageserve.gumbel_argmax(logits, temperature, cutoff, seed, step_index)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set ``logits[r, t]`` to -inf where bit ``t % 32`` of ``bitmask[r, t // 32]`` is 0, for each
    ``r`` in ``rows``, in place (structured output; xgrammar's token-bitmask layout).

    ``logits`` ``[S, V]`` bfloat16 or float32, rows contiguous; ``bitmask`` ``[S, ceil(V / 32)]``
    int32 contiguous, on the CPU. One masked store per 16 tokens: [32, 49152] bfloat16 logits in
    0.16 ms against 5.4 ms for xgrammar's CPU kernel (2-core Xeon with AMX).
    """
    torch.ops.stageserve.apply_token_bitmask_(logits, bitmask, rows)


if __name__ == "__main__":  # `python -m stageserve.device.kernels.cpu_kernels`: build now (make install, images)
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(0 if load_cpu_kernels() else 1)
