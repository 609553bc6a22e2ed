"""The suite's K-quant writer (`tests/kquant_writer.py`) read back by gguf's dequantizer: its blocks
are ggml-quants.c's layouts, so the embedded model's requantized mixes are files llama.cpp would read.

Bounds, per value, on Gaussian rows: Q6_K rounds each value to a step ``d sc`` of about a 31st of its
16 values' largest magnitude, Q4_K to about a 15th of its 32 values' range; both steps are themselves
rounded (6- and 8-bit scales, float16 factors), so the error stays below 0.6 steps of the largest.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from tests.kquant_writer import q4_k_blocks, q6_k_blocks, quantized, relative_errors

Q = gguf.GGMLQuantizationType
ROWS, K = 8, 512  # two super-blocks of 256 a row


@pytest.fixture
def weights() -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((ROWS, K)) * 0.02).astype(np.float32)


@pytest.mark.parametrize("qtype, write, group, levels", [(Q.Q6_K, q6_k_blocks, 16, 63), (Q.Q4_K, q4_k_blocks, 32, 15)])
def test_gguf_reads_the_blocks_back_within_their_rounding(weights, qtype, write, group, levels):
    blocks = write(weights)
    assert blocks.shape == (ROWS * K // 256, gguf.GGML_QUANT_SIZES[qtype][1])
    back = dequantize(blocks.reshape(ROWS, -1), qtype).reshape(ROWS, K)
    spans = weights.reshape(-1, group)
    step = (spans.max(-1) - np.minimum(spans.min(-1), 0)) / levels if qtype == Q.Q4_K else 2 * np.abs(spans).max(-1) / levels
    error = np.abs(back - weights).reshape(-1, group).max(-1)
    assert (error <= 0.6 * step).all(), float((error / step).max())


def test_quantized_weights_keep_the_blocks_and_report_their_error(weights):
    dense = {"w": torch.from_numpy(weights), "norm": torch.ones(K)}
    weight = quantized(dense["w"], Q.Q6_K)
    assert weight.qtype == Q.Q6_K and tuple(weight.blocks.shape) == (ROWS, K // 256, 210)
    errors = relative_errors({"w": weight, "norm": dense["norm"]}, dense)
    assert list(errors) == ["Q6_K"] and 0 < errors["Q6_K"][0] < 0.02
