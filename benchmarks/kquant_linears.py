"""The VNNI kernel on GGUF's K-quant, Q5 and Q8_0 blocks against Q4_0 on it and the dense bfloat16 linear, per row count.

Layer linears of a 1B Llama's shapes (Llama-3.2-1B: qkv 3072x2048, o 2048x2048, gate_up 16384x2048,
down 2048x8192; every K a multiple of the K-quants' super-block of 256, which the embedded model's
576 is not), ``--layers`` layers of distinct random valid blocks so each pass streams them from
memory as a decode step does, bfloat16 inputs, wall time of one pass at ``--threads``, median of
``--repeats`` (``--cpu-time``: the calling thread's CPU time on one thread, least of ``--repeats``,
which preemption by other work on a shared machine does not enter), the kernels one after another per row count:

- ``q4_0`` … ``q8_0``: `quant_linear.VnniKernel` on that block type, on ``--input-bits`` (8: one
  int8 level, as the device runs bfloat16 inputs without a dense copy; 16: two, beside one);
- ``torch q4_k``: Q4_K on torch's int4 kernel (`TorchInt4Kernel`, the fallback without AVX512-VNNI);
- ``bf16``: the dense bfloat16 weight as oneDNN's packed linear (`Linear`; what a CPU without AMX keeps).

Also prints each format's bytes per weight as held against the file's.

    python benchmarks/kquant_linears.py --rows 1 32 --threads 2 [--input-bits 16]
    python benchmarks/kquant_linears.py --rows 1 32 --cpu-time
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch
from quant_linears import timed_ms

from stageserve.device.kernels import cpu_kernels, quant
from stageserve.device.kernels.quant_linear import TorchInt4Kernel, VnniKernel, as_int4
from stageserve.device.model.linear import Linear

Q = gguf.GGMLQuantizationType
LAYER_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
TYPES = [Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0]
F16_BYTES = {Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q8_0: (0,)}  # each block's float16 factors


def random_weight(qtype: gguf.GGMLQuantizationType, n: int, k: int, rng: np.random.Generator) -> quant.QuantizedWeight:
    """Random valid blocks of ``qtype`` for an ``[n, k]`` weight (random bytes, float16 factors of about 0.001)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    for byte in F16_BYTES[qtype]:
        blocks[..., byte : byte + 2] = (rng.standard_normal((n, k // block, 1)) * 1e-3).astype(np.float16).view(np.uint8)
    return quant.from_gguf_bytes(torch.from_numpy(blocks.reshape(-1)), qtype, (n, k))


def least_thread_ms(fn, repeats: int) -> float:
    """Least thread CPU ms of ``fn()`` over ``repeats`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cpu-time", action="store_true", help="thread CPU time on one thread (least of --repeats) instead of wall time")
    parser.add_argument("--input-bits", type=int, default=8, choices=[8, 16], help="the VNNI kernel's input: one or two int8 levels (default %(default)s)")
    args = parser.parse_args()
    if args.cpu_time:
        args.threads = 1
    if not cpu_kernels.has_avx512_vnni():
        raise SystemExit("the VNNI kernel does not run on this CPU (AVX512-VNNI and stageserve's CPU kernels needed)")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    layers: list[tuple[int, dict]] = []
    held = {t.name.lower(): 0 for t in TYPES}
    for _ in range(args.layers):
        for n, k in LAYER_SHAPES:
            kernels = {}
            for qtype in TYPES:
                weight = quant.kernel_weight([random_weight(qtype, n, k, rng)], "auto")
                kernels[qtype.name.lower()] = VnniKernel(weight, torch.bfloat16, args.input_bits)
                held[qtype.name.lower()] += sum(t.nbytes for t in kernels[qtype.name.lower()].tensors())
                if qtype == Q.Q4_K:
                    kernels["torch q4_k"] = TorchInt4Kernel(as_int4(weight), torch.bfloat16)
            kernels["bf16"] = Linear(kernels["q4_k"].dense_weight())
            layers.append((k, kernels))
    weights = args.layers * sum(n * k for n, k in LAYER_SHAPES)
    for qtype in TYPES:
        block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
        print(f"{qtype.name}: held {8 * held[qtype.name.lower()] / weights:.4f} bits per weight, file {8 * nbytes / block:.4f}")
    names = list(layers[0][1])
    timer, what = (least_thread_ms, "thread CPU time, least") if args.cpu_time else (timed_ms, "wall time, median")
    print(f"{args.layers * len(LAYER_SHAPES)} layer linears of {weights / 1e6:.0f} M weights (ms per pass), bfloat16 inputs, "
          f"{args.threads} threads, {what} of {args.repeats}, the VNNI kernel's input on {args.input_bits // 8} int8 level(s)")
    print("| rows | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in {k for k, _ in layers}}
        cells = [timer(lambda name=name: [kernels[name](inputs[k]) for k, kernels in layers], args.repeats) for name in names]
        print(f"| {rows} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
