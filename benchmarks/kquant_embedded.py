"""The embedded model as stored (Q4_1, Q8_0 head) and requantized to llama.cpp's Q4_K_M and Q6_K mixes
(`tests/kquant_writer.py`: a round-to-nearest writer of ggml-quants.c's layouts, Q5_0 / Q8_0 where K is
not a multiple of 256, as llama-quantize falls back), served quantized (``--weights auto``) against
the same weights dequantized: weights held, perplexity on the test passage, greedy tokens.
Both runs take bfloat16 activations and by default no dense copy (``--dense-copy none``: the
quantized kernel takes one int8 input level, `quant_linear.input_bits_for`); ``--dense-copy all``
gives every quantized linear one, and with it two input levels (the perplexity and greedy runs feed
at most 4 rows a step, so they stay on the kernel).

    python benchmarks/kquant_embedded.py [--mixes stored q4_k_m q6_k] [--dense-copy all]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test suite's passage, prompts and greedy loop
from tests.kquant_writer import MIXES, embedded_weights, relative_errors  # noqa: E402
from tests.unit.device.test_model_reference import greedy  # noqa: E402
from tests.unit.device.test_quantized_model import PASSAGE, PROMPTS, _perplexity  # noqa: E402

from stageserve.device.flags import DENSE_COPY_MODES  # noqa: E402
from stageserve.device.model.decoder import DecoderModel  # noqa: E402
from stageserve.device.model.weights import load_weights  # noqa: E402
from stageserve.model_files import embedded_model_path  # noqa: E402
from stageserve.tokenizer import load_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES,
                        help="the file as stored, or requantized to a mix (default: all three)")
    parser.add_argument("--dense-copy", default="none", choices=DENSE_COPY_MODES, help="as the device's flag (default %(default)s)")
    args = parser.parse_args()
    tokenizer = load_tokenizer(embedded_model_path())
    dense = load_weights(embedded_model_path(), torch.float32)[1]
    for mix in args.mixes:
        config, weights = embedded_weights(mix)
        errors = {} if mix == "stored" else relative_errors(weights, dense)
        models = {fmt: DecoderModel(config, weights, "cpu", weight_format=fmt, dense_copy=args.dense_copy) for fmt in ("dequantize", "auto")}
        served, held = models["auto"], models["auto"].weight_bytes()
        one_copy = served.dense_weight_bytes(torch.bfloat16)
        print(f"{mix}: mean relative error per type {', '.join(f'{t} {np.mean(e):.4f}' for t, e in errors.items()) or '(as stored)'}")
        print(f"  linears {dict(served.linear_formats)}; weights hold {held / 2**20:.1f} MiB "
              f"(one dense bfloat16 copy {one_copy / 2**20:.1f} MiB, {held / one_copy:.2f}x)")
        ids = tokenizer.encode(PASSAGE)
        reference, got = (_perplexity(models[fmt], ids) for fmt in ("dequantize", "auto"))
        print(f"  perplexity: dequantized {reference:.3f}, quantized {got:.3f} ({got / reference:.4f}x)")
        for prompt in PROMPTS:
            (ref_tokens, ref_logits), (tokens, logits) = (greedy(models[fmt], tokenizer.encode(prompt), 32) for fmt in ("dequantize", "auto"))
            part = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None)
            upto = 32 if part is None else part + 1
            line = "32 greedy tokens equal" if part is None else (
                f"part at token {part}: {ref_tokens[part]} / {tokens[part]}, their logits "
                f"{float(ref_logits[part, ref_tokens[part]] - ref_logits[part, tokens[part]]):.3f} / "
                f"{float(logits[part, ref_tokens[part]] - logits[part, tokens[part]]):.3f} apart")
            diff = (ref_logits[:upto].float() - logits[:upto].float()).abs().max()
            print(f"  {prompt!r}: {line}; largest logit difference up to there {diff:.3f}")


if __name__ == "__main__":
    main()
