"""The quantized linears' kernels against each other and against the dense bfloat16 AMX kernel, per row count.

The embedded model's shapes (SmolLM2-135M: per layer qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536; 30 layers of distinct random weights, so each pass streams them from memory as a decode
step does; the tied head 49152x576), bfloat16 inputs, wall time of one pass over the 120 layer linears
(and of one head call) at ``--threads``, median of ``--repeats`` passes, the kernels interleaved:

- ``vnni``: `quant_linear.VnniKernel` with a two-level int8 input (int4 layers, the int8 head; what
  runs beside a dense copy), and ``vnni 1-level`` with one (llama.cpp's; what runs without a copy),
  where the CPU has AVX512-VNNI;
- ``torch``: torch's ``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm`` (`TorchInt4Kernel`,
  `TorchInt8Kernel`), the fallback elsewhere;
- ``amx``: the dense bfloat16 copy on ``amx_linear`` where the CPU has AMX (what inputs of more rows run on);
- ``onednn``: the dense bfloat16 copy as oneDNN's packed linear (`Linear` without AMX: the copy a CPU
  without AMX keeps, `dense_copies`).

    python benchmarks/quant_linears.py --rows 1 2 4 8 16 32 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stageserve.device.kernels import cpu_kernels, quant
from stageserve.device.kernels.quant_linear import TorchInt4Kernel, TorchInt8Kernel, VnniKernel
from stageserve.device.model.linear import Linear

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD_SHAPE = (49152, 576)


def timed_ms(fn, repeats: int) -> float:
    """Median wall ms of ``fn()`` over ``repeats`` calls after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vnni, amx = cpu_kernels.has_avx512_vnni(), cpu_kernels.load_cpu_kernels() and torch.ops.stageserve.has_amx()
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        for n, k in LAYER_SHAPES:
            weight = quant.int4_from_float(torch.randn(n, k) * 0.02)
            kernels = {"torch": TorchInt4Kernel(weight, torch.bfloat16)}
            if vnni:
                kernels |= {"vnni": VnniKernel(weight, torch.bfloat16, input_bits=16), "vnni 1-level": VnniKernel(weight, torch.bfloat16, input_bits=8)}
            if amx:
                packed = cpu_kernels.amx_pack(kernels["torch"].dense_weight())
                kernels["amx"] = lambda x, packed=packed: cpu_kernels.amx_linear(x, packed)
            kernels["onednn"] = Linear(kernels["torch"].dense_weight())
            layers.append((k, kernels))
    head = quant.int8_from_float(torch.randn(*HEAD_SHAPE) * 0.02)
    heads = {"torch": TorchInt8Kernel(head, torch.bfloat16)}
    if vnni:
        heads |= {"vnni": VnniKernel(head, torch.bfloat16, input_bits=16), "vnni 1-level": VnniKernel(head, torch.bfloat16, input_bits=8)}
    if amx:
        packed_head = cpu_kernels.amx_pack(heads["torch"].dense_weight())
        heads["amx"] = lambda x: cpu_kernels.amx_linear(x, packed_head)
    heads["onednn"] = Linear(heads["torch"].dense_weight())
    names = list(layers[0][1])
    print(f"{args.layers * len(LAYER_SHAPES)} layer linears (ms per pass) and the {HEAD_SHAPE[0]}x{HEAD_SHAPE[1]} head (ms per call), "
          f"bfloat16 inputs, {args.threads} threads, median of {args.repeats}")
    print("| rows | " + " | ".join(f"layers {n}" for n in names) + " | " + " | ".join(f"head {n}" for n in heads) + " |")
    print("|---:|" + "---:|" * (len(names) + len(heads)))
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).bfloat16() for k in {k for k, _ in layers}}
        cells = [timed_ms(lambda name=name: [kernels[name](inputs[k]) for k, kernels in layers], args.repeats) for name in names]
        x = torch.randn(rows, HEAD_SHAPE[1]).bfloat16()
        cells += [timed_ms(lambda kernel=kernel: kernel(x), args.repeats) for kernel in heads.values()]
        print(f"| {rows} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
