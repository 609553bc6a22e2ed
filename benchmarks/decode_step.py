"""Decode step time and tokens/s of the device's model against Hugging Face transformers ``generate``.

Both sides run in this one process, on the same model file, device, dtype, torch threads, batch and
context, one after the other for each batch size, so the ratio is measured side by side:

- **stageserve**: ``DecoderModel`` over the paged KV cache plus the on-device sampler (greedy), one
  batched decode step per token, prompts of ``--context`` tokens prefilled first; where the fused CPU
  kernels are in use, the same model in plain torch ops runs alongside, where a decode step's
  layers run as one C++ call (``model/fused_decode.py``), the same model with them op by op, and
  where the quantized kernels' weights are on huge pages (``kernels/huge_pages.py``), the same model
  with copies of them on ordinary (4 KiB) pages;
- **transformers**: ``AutoModelForCausalLM.generate`` (greedy, static batch, KV cache), decode time
  per step = (time for 1 + N new tokens − time for 1 new token) / N, so the prefill is excluded.

Prints a Markdown table (median of ``--repeats`` runs). Usage::

    python benchmarks/decode_step.py --dtype bfloat16 --batch 1 8 32 64 --context 128 --steps 32
    python benchmarks/decode_step.py --device cuda --model DIR --batch 1 32 256   # on a GPU

On an accelerator both sides synchronize the device before reading the clock.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.forward_batch import build_forward_batch
from stageserve.device.kernels.quant_linear import vnni_kernels
from stageserve.device.model.decoder import DecoderModel
from stageserve.device.model.fused_decode import FusedDecodeLayers
from stageserve.device.flags import DENSE_COPY_MODES, WEIGHT_FORMATS
from stageserve.device.sampler import argmax_rows
from stageserve.device.model.weights import load_weights
from stageserve.model_files import embedded_model_path, transformers_source

BLOCK_SIZE = 16


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def ours_decode_ms(model: DecoderModel, batch: int, context: int, steps: int) -> float:
    """Median ms of one batched greedy decode step at ``batch`` rows, context ``context`` → ``context+steps``."""
    device = model.device
    blocks_per_row = (context + steps) // BLOCK_SIZE + 1
    cache = PagedKVCache(model.config, batch * blocks_per_row, BLOCK_SIZE, model.dtype, device)
    tables = [list(range(r * blocks_per_row, (r + 1) * blocks_per_row)) for r in range(batch)]
    prompt = [(7 * i) % 1000 + 10 for i in range(context)]
    tokens = []
    with torch.inference_mode():
        for r in range(batch):  # prefill each row alone; only decode is timed
            logits = model.forward(build_forward_batch([(prompt, 0, tables[r], True)], BLOCK_SIZE, device), cache)
            tokens.append(int(logits.argmax(-1)))
        times = []
        synchronize(device)
        for step in range(steps):
            start = time.perf_counter()
            rows = [([tokens[r]], context + step, tables[r], True) for r in range(batch)]
            logits = model.forward(build_forward_batch(rows, BLOCK_SIZE, device), cache)
            tokens = argmax_rows(logits, model.cpu_kernels).tolist()  # the sampler's greedy path; .tolist() synchronizes
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


class HugePageSides:
    """The model's VNNI kernel weights as the model holds them (on huge pages) and copies of them on
    ordinary pages (``clone``: the allocator's 4 KiB pages), to switch between; ``moved`` says whether
    the model holds such weights on huge pages at all."""

    def __init__(self, model: DecoderModel) -> None:
        self.model = model
        self.kernels = vnni_kernels(model.linears_in_step_order())
        self.huge = [(k.packed, k.scales) for k in self.kernels]
        self.moved = len(self.huge) > 1 and len({packed.untyped_storage().data_ptr() for packed, _ in self.huge}) == 1
        self.small = [(packed.clone(), scales.clone()) for packed, scales in self.huge] if self.moved else []

    def use(self, small: bool) -> None:
        """Point the kernels at the copies on ordinary pages (``small``) or back at the model's own."""
        for kernel, (packed, scales) in zip(self.kernels, self.small if small else self.huge):
            kernel.packed, kernel.scales = packed, scales
        if self.model.fused_decode is not None:  # it holds the tensors it was built with
            self.model.fused_decode = FusedDecodeLayers.for_model(self.model)


def transformers_decode_ms(hf_model, batch: int, context: int, steps: int) -> float:
    """Decode ms per step of ``generate`` (greedy, static batch), prefill subtracted."""
    ids = torch.tensor([[(7 * i) % 1000 + 10 for i in range(context)]] * batch, device=hf_model.device)
    mask = torch.ones_like(ids)

    def timed(new_tokens: int) -> float:
        synchronize(hf_model.device)
        start = time.perf_counter()
        with torch.inference_mode():
            hf_model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        synchronize(hf_model.device)
        return time.perf_counter() - start

    timed(2)  # warm-up
    return (timed(1 + steps) - timed(1)) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--model", type=Path, default=None, help="GGUF file or HF directory (default: the embedded model)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | npu (default %(default)s)")
    parser.add_argument("--no-transformers", action="store_true",
                        help="time stageserve's model only (a file transformers' GGUF loader refuses: llama.cpp's Qwen3 and MoE conversions)")
    parser.add_argument("--weights", default="dequantize", choices=WEIGHT_FORMATS,
                        help="stageserve's linears, as the device's --weights (default %(default)s; transformers always dequantizes)")
    parser.add_argument("--dense-copy", default="auto", choices=DENSE_COPY_MODES,
                        help="which quantized linears keep a dense copy, as the device's flag (default %(default)s)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    path = args.model or embedded_model_path()
    if args.device.startswith("npu"):
        import torch_npu  # noqa: F401 - registers the npu device type
    device = torch.device(args.device)
    config, weights = load_weights(path, dtype, keep_quantized=args.weights != "dequantize")
    ours = DecoderModel(config, weights, device, weight_format=args.weights, dense_copy=args.dense_copy)
    # The same model in plain torch ops, where the fused CPU kernels are in use.
    ours_torch = (DecoderModel(config, weights, device, cpu_kernels_allowed=False, weight_format=args.weights, dense_copy=args.dense_copy)
                  if ours.cpu_kernels else None)
    del weights
    one_call = ours.fused_decode  # the decode layers as one C++ call, or None (switched off for the per-op side)
    huge_pages = HugePageSides(ours)
    hf = None
    if not args.no_transformers:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(**transformers_source(path), dtype=dtype).to(device).eval()
    print(f"model {path.name}, {args.device}, dtype {args.dtype}, weights {args.weights}, threads {args.threads}, context {args.context}, {args.steps} decode steps, median of {args.repeats}")
    print(f"stageserve layers: {'fused CPU kernels (plain torch ops shown alongside)' if ours_torch else 'plain torch ops'}")
    print("| batch | stageserve step ms | stageserve tokens/s | transformers step ms | transformers tokens/s | ratio |"
          + (" plain-torch step ms | kernels speed-up |" if ours_torch else "") + (" per-op layers step ms | one-call speed-up |" if one_call else "")
          + (" 4 KiB pages step ms | huge-page speed-up |" if huge_pages.moved else ""))
    print("|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if ours_torch else "") + ("---:|---:|" if one_call else "")
          + ("---:|---:|" if huge_pages.moved else ""))
    for batch in args.batch:
        ours_ms, hf_ms, torch_ms, per_op_ms, small_pages_ms = [], [], [], [], []
        for _ in range(args.repeats):  # the sides alternate, so machine noise hits them alike
            ours_ms.append(ours_decode_ms(ours, batch, args.context, args.steps))
            if hf is not None:
                hf_ms.append(transformers_decode_ms(hf, batch, args.context, args.steps))
            if ours_torch:
                torch_ms.append(ours_decode_ms(ours_torch, batch, args.context, args.steps))
            if one_call is not None:
                ours.fused_decode = None
                per_op_ms.append(ours_decode_ms(ours, batch, args.context, args.steps))
                ours.fused_decode = one_call
            if huge_pages.moved:
                huge_pages.use(small=True)
                small_pages_ms.append(ours_decode_ms(ours, batch, args.context, args.steps))
                huge_pages.use(small=False)
        ours_ms = statistics.median(ours_ms)
        row = f"| {batch} | {ours_ms:.2f} | {batch / ours_ms * 1e3:.0f} |"
        if hf_ms:
            hf_ms = statistics.median(hf_ms)
            row += f" {hf_ms:.1f} | {batch / hf_ms * 1e3:.0f} | {hf_ms / ours_ms:.2f}x |"
        else:
            row += " - | - | - |"
        if ours_torch:
            row += f" {statistics.median(torch_ms):.1f} | {statistics.median(torch_ms) / ours_ms:.2f}x |"
        if per_op_ms:
            row += f" {statistics.median(per_op_ms):.2f} | {statistics.median(per_op_ms) / ours_ms:.2f}x |"
        if small_pages_ms:
            row += f" {statistics.median(small_pages_ms):.2f} | {statistics.median(small_pages_ms) / ours_ms:.2f}x |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
