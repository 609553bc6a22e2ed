"""Weight-only quantized linears against the dequantized float32 reference, on random weights.

Error bounds (per output element, ``|x|`` the absolute input, ``G`` the largest ``|w|`` of each
weight's group of 32, ``R`` of its row):

- float32 activations, Q4_0/Q4_1 → int4: the map is exact, so only float32 summation order:
  ``1e-5 * (|x| @ G.T)``.
- bfloat16 activations: scale and zero rounded to bfloat16 (relative 2**-9 of each, both at most
  ``8 G``-ish in magnitude), products summed in float32, the output rounded to bfloat16:
  ``2**-6 * (|x| @ G.T)``.
- Q8_0 → int8 per row: requantization to ``R / 127`` adds at most ``R / 254`` per weight:
  ``(|x| @ R.T) / 254`` on top of the bound above.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from stageserve.device import quant
from stageserve.device.quant import QuantizedLinear, QuantizedWeight

Q = gguf.GGMLQuantizationType
N, K = 192, 96  # three of the int4 kernel's 64-row blocks, three groups of 32


def _gguf_weight(qtype: gguf.GGMLQuantizationType, seed: int = 0) -> QuantizedWeight:
    """A random [N, K] weight quantized with gguf-py's reference quantizer (as llama.cpp writes it)."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    w[:, :32] += 0.02  # a group with a non-zero mean, so Q4_1's offset matters
    raw = torch.from_numpy(quantize(w, qtype).reshape(-1).view(np.uint8).copy())
    return quant.from_gguf_bytes(raw, qtype, (N, K))




def _bounds(reference: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``|x| @ G.T`` and ``|x| @ R.T`` for the reference weight (see the module docstring)."""
    group_max = reference.abs().view(N, K // 32, 32).amax(-1).repeat_interleave(32, 1)
    row_max = reference.abs().amax(-1, keepdim=True).expand(N, K)
    return x.abs().float() @ group_max.T, x.abs().float() @ row_max.T


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])  # the quantized kernel (<= max_rows) and the per-call dequantized weight
def test_gguf_linear_matches_the_dequantized_reference(qtype, dtype, rows):
    weight = _gguf_weight(qtype)
    reference = weight.dequantize()
    kernel = quant.kernel_weight([weight], "auto")
    assert quant.format_name(kernel) == ("int8" if qtype == Q.Q8_0 else "int4")
    bias = torch.linspace(-1, 1, N).to(dtype)
    linear = QuantizedLinear(kernel, bias, dtype, max_rows=8)
    x = torch.randn(rows, K).to(dtype)
    got = linear(x).float()
    expected = x.float() @ reference.T + bias.float()
    by_group, by_row = _bounds(reference, x)
    bound = (1e-5 if dtype == torch.float32 else 2**-6) * by_group + 1e-6
    if qtype == Q.Q8_0:
        bound = bound + by_row / 254
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    assert ((got - expected).abs() <= bound).all(), ((got - expected).abs() / bound).max()
    assert linear(x).dtype == dtype


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_int4_dense_weight_is_the_gguf_dequantization(qtype):
    """The weight rebuilt from the kernel's packed layout (for inputs of many rows) is Q4's own values."""
    weight = _gguf_weight(qtype, seed=1)
    linear = QuantizedLinear(quant.kernel_weight([weight], "auto"), None, torch.float32)
    torch.testing.assert_close(linear.dense_weight(), weight.dequantize(), rtol=0, atol=1e-7)


def test_int4_and_int8_from_float_round_to_nearest_within_half_a_step():
    w = torch.randn(128, 64)
    int4, int8 = quant.kernel_weight([w], "int4"), quant.kernel_weight([w], "int8")
    back4 = QuantizedLinear(int4, None, torch.float32).dense_weight()
    back8 = QuantizedLinear(int8, None, torch.float32).dense_weight()
    step4 = int4.scale.repeat_interleave(32, 1)
    assert ((back4 - w).abs() <= step4 / 2 + 1e-6).all()
    assert ((back8 - w).abs() <= int8.scale[:, None] / 2 + 1e-6).all()


def test_parts_are_stacked_and_mixed_or_float_parts_stay_dense():
    q4_0, q4_1, q8 = _gguf_weight(Q.Q4_0), _gguf_weight(Q.Q4_1, seed=2), _gguf_weight(Q.Q8_0)
    stacked = quant.kernel_weight([q4_0, q4_1], "auto")
    expected = torch.cat([q4_0.dequantize(), q4_1.dequantize()])
    torch.testing.assert_close(QuantizedLinear(stacked, None, torch.float32).dense_weight(), expected, rtol=0, atol=1e-7)
    assert quant.kernel_weight([q4_0, q8], "auto") is None  # int4 and int8 parts: no common kernel
    assert quant.kernel_weight([q4_0, torch.zeros(N, K)], "auto") is None  # auto never quantizes float weights
    assert quant.kernel_weight([q4_0], "dequantize") is None
    assert quant.format_name(quant.kernel_weight([q4_0, q8], "int4")) == "int4"  # explicit formats convert everything
    assert quant.kernel_weight([torch.zeros(96, 64)], "int4") is None  # 96 rows: not a whole number of the kernel's 64-row blocks
    with pytest.raises(ValueError, match="expected one of"):
        quant.kernel_weight([q4_0], "int3")


def test_int8_rows_serve_as_the_tied_embedding_table():
    weight = _gguf_weight(Q.Q8_0)
    linear = QuantizedLinear(quant.kernel_weight([weight], "auto"), None, torch.float32)
    ids = torch.tensor([0, 7, 191, 7])
    torch.testing.assert_close(linear.embedding(ids), linear.dense_weight()[ids])


def test_k_quant_tensors_are_dequantized_with_a_log_line(tmp_path, caplog):
    """A Q6_K tensor has no kernel here: the loader dequantizes it and says so; Q4_0 stays as stored."""
    from stageserve.device.weights import load_weights
    from tests.unit.device.test_weights import write_gguf

    path = tmp_path / "k.gguf"
    write_gguf(path, {"blk.0.ffn_down.weight": Q.Q6_K, "blk.0.ffn_gate.weight": Q.Q4_0}, ffn=256)
    with caplog.at_level(logging.INFO, logger="stageserve.device.weights"):
        _, weights = load_weights(path, torch.float32, keep_quantized=True)
    assert isinstance(weights["model.layers.0.mlp.gate_proj.weight"], QuantizedWeight)
    assert weights["model.layers.0.mlp.down_proj.weight"].dtype == torch.float32
    assert "Q6_K dequantized to float32" in caplog.text


@pytest.mark.parametrize("gated", [False, True])
def test_the_dense_companion_runs_any_row_count_on_its_one_amx_copy(gated):
    """``Linear(one_copy=True)`` (a quantized linear's dense copy) holds only the AMX copy and runs
    inputs of more than 64 rows on it 64 at a time, as oneDNN would compute them."""
    from stageserve.device import cpu_kernels
    from stageserve.device.model import Linear

    weight = (torch.randn(2 * 256 if gated else 256, 128) * 0.05).bfloat16()
    if not cpu_kernels.amx_ready(weight, gated):
        pytest.skip("no AMX-BF16 on this CPU (or no CPU kernels): the companion is oneDNN's packed linear")
    linear = Linear(weight, amx=True, gated=gated, one_copy=True)
    assert linear.weight is None and linear.amx_weight is not None
    x = torch.randn(150, 128).bfloat16()
    dense = x.float() @ weight.float().T
    expected = torch.nn.functional.silu(dense[:, :256]) * dense[:, 256:] if gated else dense
    got = (linear.swiglu(x) if gated else linear(x)).float()
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
