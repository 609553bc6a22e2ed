"""Weight-only quantized linears against the dequantized float32 reference, on random weights.

Error bounds (per output element, ``|x|`` the absolute input, ``G`` the largest ``|w|`` of each
weight's group of 32, ``R`` of its row, ``X`` the largest ``|x|`` of each input's group of 32):

- float32 activations, Q4_0/Q4_1/Q8_0 mapped exactly: only float32 summation order:
  ``1e-5 * (|x| @ G.T)``.
- bfloat16 activations: (torch's kernels) scale and zero rounded to bfloat16 (relative 2**-9 of
  each, both at most ``8 G``-ish in magnitude), products summed in float32, the output rounded to
  bfloat16: ``2**-6 * (|x| @ G.T)``.
- the VNNI kernel quantizes each input to int8 in groups of 32, at most ``X / 254`` per input with
  one level (``input_bits=8``): ``(X / 254) @ |w|.T`` on top (``quant_linear.VnniKernel``; the
  two levels it takes beside a dense copy are tested against a 127 times tighter bound below). The same for every block
  type: Q5_0/Q5_1 and the K-quants (Q4_K/Q5_K/Q6_K) hold GGUF's values exactly too.
- torch's int8 kernel requantizes Q8_0 per row to ``R / 127``, at most ``R / 254`` per weight:
  ``(|x| @ R.T) / 254`` on top.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from stageserve.device.kernels import cpu_kernels, quant
from stageserve.device.kernels.quant import QuantizedWeight
from stageserve.device.kernels.quant_linear import (GROUP_SCALES, GROUP_SYMMETRIC_SCALES, QuantizedLinear, TorchInt4Kernel, TorchInt8Kernel,
                                                     VnniKernel, fits)
from stageserve.device.model.linear import Linear

Q = gguf.GGMLQuantizationType
N, K = 192, 96  # three of torch's int4 kernel's 64-row blocks, three groups of 32
K_SUPER = 512  # two K-quant super-blocks of 256
VNNI = cpu_kernels.has_avx512_vnni()
NEW_TYPES = [Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]  # gguf-py quantizes Q5_0/Q5_1, not the K-quants
# where each type's float16 factors sit in its block (d, and m or dmin)
F16_BYTES = {Q.Q4_0: (0,), Q.Q8_0: (0,), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,)}


def _gguf_weight(qtype: gguf.GGMLQuantizationType, seed: int = 0) -> QuantizedWeight:
    """A random [N, K] weight quantized with gguf-py's reference quantizer (as llama.cpp writes it)."""
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    w[:, :32] += 0.02  # a group with a non-zero mean, so Q4_1's offset matters
    raw = torch.from_numpy(quantize(w, qtype).reshape(-1).view(np.uint8).copy())
    return quant.from_gguf_bytes(raw, qtype, (N, K))


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid random blocks of ``qtype`` for a ``[rows, k]`` weight, uint8 ``[rows, bytes]``: random
    bytes, with every float16 factor set to a finite random value of about 0.01."""
    rng = np.random.default_rng(seed)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, k // block, nbytes), dtype=np.uint8)
    for byte in F16_BYTES[qtype]:
        blocks[..., byte : byte + 2] = (rng.standard_normal((rows, k // block, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _random_weight(qtype: gguf.GGMLQuantizationType, rows: int = N, seed: int = 0) -> QuantizedWeight:
    """A random [rows, K_SUPER] weight of ``qtype`` from `random_blocks`."""
    return quant.from_gguf_bytes(torch.from_numpy(random_blocks(qtype, rows, K_SUPER, seed).reshape(-1)), qtype, (rows, K_SUPER))


def _bound(linear: QuantizedLinear, reference: torch.Tensor, x: torch.Tensor, input_bits: int = 8) -> torch.Tensor:
    """The error bound of ``linear(x)`` against ``x @ reference.T`` (see the module docstring)."""
    x = x.float()
    n, k = reference.shape
    group_max = reference.abs().view(n, k // 32, 32).amax(-1).repeat_interleave(32, 1)
    bound = (1e-5 if linear.kernel.dtype == torch.float32 else 2**-6) * (x.abs() @ group_max.T) + 1e-6
    if isinstance(linear.kernel, VnniKernel) and (x.shape[0] <= linear.kernel.max_rows or linear.dense is None):
        input_max = x.abs().view(-1, k // 32, 32).amax(-1).repeat_interleave(32, 1)
        bound = bound + (input_max / 254 / (127 if input_bits == 16 else 1)) @ reference.abs().T
    if isinstance(linear.kernel, TorchInt8Kernel):  # the dense weight is the requantized one too
        bound = bound + (x.abs() @ reference.abs().amax(-1, keepdim=True).expand(n, k).T) / 254
    return bound


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# up to max_rows: the kernel in one pass; above, with no dense copy: the VNNI kernel in passes, or torch's kernels' per-call dequantized weight
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 40])
@pytest.mark.parametrize("cpu", ["this", "without VNNI"])
def test_gguf_linear_matches_the_dequantized_reference(qtype, dtype, rows, cpu, monkeypatch):
    if cpu != "this":  # torch's kernels, as on a CPU without AVX512-VNNI
        monkeypatch.setattr(cpu_kernels, "has_avx512_vnni", lambda: False)
    weight = _gguf_weight(qtype)
    reference = weight.dequantize()
    kernel = quant.kernel_weight([weight], "auto")
    assert quant.format_name(kernel) == ("int8" if qtype == Q.Q8_0 else "int4")
    bias = torch.linspace(-1, 1, N).to(dtype)
    linear = QuantizedLinear(kernel, bias, dtype, input_bits=8)  # one input level: the bound below; two: the next test
    assert isinstance(linear.kernel, VnniKernel) == (VNNI and cpu == "this")
    x = torch.randn(rows, K).to(dtype)
    got = linear(x).float()
    expected = x.float() @ reference.T + bias.float()
    bound = _bound(linear, reference, x)
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    assert ((got - expected).abs() <= bound).all(), ((got - expected).abs() / bound).max()
    assert linear(x).dtype == dtype


@pytest.mark.skipif(not VNNI, reason="the VNNI kernel needs AVX512-VNNI")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_beside_a_dense_copy_two_input_levels_leave_a_127th_of_the_input_rounding(qtype, rows):
    """bfloat16 activations take one input level without a dense copy; beside one (and in float32)
    two (``input_bits=16``): the input's second int8 level takes what the first rounded off, so the
    error bound of the input rounding shrinks 127-fold (float32 activations and output, as two levels
    give in bfloat16); dropping the copy goes back to one level in bfloat16."""
    weight = _gguf_weight(qtype)
    reference = weight.dequantize()
    bf16 = QuantizedLinear(quant.kernel_weight([weight], "auto"), None, torch.bfloat16, make_dense=Linear)
    assert bf16.kernel.input_bits == 8
    bf16.keep_dense_copy()
    assert bf16.kernel.input_bits == 16 and bf16.kernel.max_rows == 8
    bf16.hold_dense(None)
    assert bf16.kernel.input_bits == 8
    linear = QuantizedLinear(quant.kernel_weight([weight], "auto"), None, torch.float32)
    assert linear.kernel.input_bits == 16
    x = torch.randn(rows, K)
    input_max = x.abs().view(-1, K // 32, 32).amax(-1).repeat_interleave(32, 1)
    bound = 1e-5 * (x.abs() @ reference.abs().T) + (input_max / 254 / 127) @ reference.abs().T + 1e-6
    assert ((linear(x) - x @ reference.T).abs() <= bound).all()


@pytest.mark.skipif(not VNNI, reason="the VNNI kernel needs AVX512-VNNI")
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("input_bits", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gives_the_same_bits_alone_and_among_other_rows(qtype, input_bits, dtype):
    """Batch invariance: every row of a 2- to 11-row input (one pass of up to 8 rows, then a shorter
    one) is bit-equal to that row run alone, so a speculative verification's rows get a plain decode
    step's logits and concurrent requests don't change each other's tokens."""
    linear = QuantizedLinear(quant.kernel_weight([_gguf_weight(qtype)], "auto"), None, dtype, input_bits=input_bits)
    x = torch.randn(11, K).to(dtype)
    alone = torch.cat([linear.kernel(x[r:r + 1]) for r in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(linear.kernel(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1] + ([Q.Q8_0] if VNNI else []))  # torch's int8 kernel requantizes per row
def test_dense_weight_is_the_gguf_dequantization(qtype):
    """The weight rebuilt from the kernel's packed layout (for inputs of many rows) is GGUF's own values."""
    weight = _gguf_weight(qtype, seed=1)
    linear = QuantizedLinear(quant.kernel_weight([weight], "auto"), None, torch.float32)
    torch.testing.assert_close(linear.dense_weight(), weight.dequantize(), rtol=0, atol=1e-7)


@pytest.mark.skipif(not VNNI, reason="the VNNI kernel needs AVX512-VNNI")
@pytest.mark.parametrize("qtype, scheme, bits", [(Q.Q4_0, GROUP_SYMMETRIC_SCALES, 4.5), (Q.Q5_0, GROUP_SYMMETRIC_SCALES, 5.5),
                                                 (Q.Q8_0, GROUP_SYMMETRIC_SCALES, 8.5), (Q.Q4_1, GROUP_SCALES, 5), (Q.Q5_1, GROUP_SCALES, 6)])
def test_the_symmetric_formats_hold_their_scale_alone_the_files_bits(qtype, scheme, bits):
    """GGUF's Q4_0/Q5_0/Q8_0 (``m = -2^(bits - 1) d``) keep ``d`` alone: as many bits a weight as the file."""
    weight = _gguf_weight(qtype, seed=2)
    kernel = QuantizedLinear(quant.kernel_weight([weight], "auto"), None, torch.bfloat16).kernel
    assert isinstance(kernel, VnniKernel) and kernel.scheme == scheme
    assert 8 * sum(t.nbytes for t in kernel.tensors()) == bits * N * K


def test_int4_and_int8_from_float_round_to_nearest_within_half_a_step():
    w = torch.randn(128, 64)
    int4, int8 = quant.kernel_weight([w], "int4"), quant.kernel_weight([w], "int8")
    back4 = QuantizedLinear(int4, None, torch.float32).dense_weight()
    back8 = QuantizedLinear(int8, None, torch.float32).dense_weight()
    step4 = int4.scale.repeat_interleave(32, 1)
    step8 = int8.scale.repeat_interleave(32, 1)
    if not VNNI:  # torch's int8 kernel requantizes each row of those values to one scale: a second half step
        step8 = step8 + w.abs().amax(-1, keepdim=True) / 127
    rounding = 2**-10 * w.abs().view(128, 2, 32).amax(-1).repeat_interleave(32, 1)  # the VNNI kernel's float16 scales
    assert ((back4 - w).abs() <= step4 / 2 + rounding + 1e-6).all()
    assert ((back8 - w).abs() <= step8 / 2 + rounding + 1e-6).all()


def test_parts_are_stacked_and_mixed_or_float_parts_stay_dense():
    q4_0, q4_1, q8 = _gguf_weight(Q.Q4_0), _gguf_weight(Q.Q4_1, seed=2), _gguf_weight(Q.Q8_0)
    stacked = quant.kernel_weight([q4_0, q4_1], "auto")
    expected = torch.cat([q4_0.dequantize(), q4_1.dequantize()])
    torch.testing.assert_close(QuantizedLinear(stacked, None, torch.float32).dense_weight(), expected, rtol=0, atol=1e-7)
    assert quant.format_name(quant.kernel_weight([q4_1, q8], "auto")) == "int4+int8"  # Q4_1's minimum: no int8 values, side by side
    assert quant.kernel_weight([q4_0, torch.zeros(N, K)], "auto") is None  # auto never quantizes float weights
    assert quant.kernel_weight([q4_0], "dequantize") is None
    assert quant.format_name(quant.kernel_weight([q4_1, q8], "int4")) == "int4"  # explicit formats convert everything
    assert not fits(quant.kernel_weight([torch.zeros(40, 64)], "int4"))  # 40 rows: not a whole number of 16-row panels (or torch's 64-row blocks)
    with pytest.raises(ValueError, match="no quantized kernel"):
        QuantizedLinear(quant.kernel_weight([torch.zeros(40, 64)], "int4"), None, torch.float32)
    with pytest.raises(ValueError, match="expected one of"):
        quant.kernel_weight([q4_0], "int3")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_serve_as_the_tied_embedding_table(dtype):
    """The rows are the dense weight's, rounded once to the activation dtype (the VNNI kernel's in one op)."""
    weight = _gguf_weight(Q.Q8_0)
    linear = QuantizedLinear(quant.kernel_weight([weight], "auto"), None, dtype)
    ids = torch.tensor([0, 7, 191, 7])
    rows = linear.embedding(ids)
    assert rows.dtype == dtype
    if isinstance(linear.kernel, VnniKernel) or dtype == torch.float32:
        assert torch.equal(rows, linear.dense_weight()[ids])
    else:  # torch's int8 kernel scales in the activation dtype
        torch.testing.assert_close(rows, linear.dense_weight()[ids])
    if isinstance(linear.kernel, VnniKernel):
        with pytest.raises(RuntimeError, match="row 192 is outside the weight's 192 rows"):
            linear.embedding(torch.tensor([3, 192]))


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q3_K])
def test_k_quant_tensors_stay_as_stored_and_the_others_are_dequantized_with_a_log_line(tmp_path, caplog, qtype):
    """Q6_K (and Q4_0) stay as stored; a Q3_K tensor has no kernel here: the loader dequantizes it and says so."""
    from stageserve.device.model.weights import load_weights
    from tests.unit.device.test_weights import write_gguf

    path = tmp_path / "k.gguf"
    write_gguf(path, {"blk.0.ffn_down.weight": qtype, "blk.0.ffn_gate.weight": Q.Q4_0}, ffn=256)
    with caplog.at_level(logging.INFO, logger="stageserve.device.model.weights"):
        _, weights = load_weights(path, torch.float32, keep_quantized=True)
    assert isinstance(weights["model.layers.0.mlp.gate_proj.weight"], QuantizedWeight)
    down = weights["model.layers.0.mlp.down_proj.weight"]
    if qtype == Q.Q6_K:
        assert down.qtype == Q.Q6_K and "dequantized" not in caplog.text
    else:
        assert down.dtype == torch.float32 and "Q3_K dequantized to float32" in caplog.text


@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_q5_and_k_quant_blocks_dequantize_as_gguf_does_bit_for_bit(qtype):
    """`QuantizedWeight.dequantize` (the loader's) equals ``gguf.quants.dequantize`` bit for bit, the
    kernel's weight rebuilt from its packed layout (what inputs of many rows run on) value for value
    (Q5_0's ``d q - 16 d`` gives +0 where gguf's ``d (q - 16)`` gives -0 for a negative ``d``)."""
    blocks = random_blocks(qtype, N, K_SUPER, seed=3)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32))
    weight = quant.from_gguf_bytes(torch.from_numpy(blocks.reshape(-1)), qtype, (N, K_SUPER))
    assert weight.shape == (N, K_SUPER)
    assert torch.equal(weight.dequantize().view(torch.int32), expected.view(torch.int32))
    if VNNI:  # elsewhere no kernel takes int5, Q5_K or Q6_K (the loader dequantizes them)
        linear = QuantizedLinear(quant.kernel_weight([weight], "auto"), None, torch.float32)
        assert isinstance(linear.kernel, VnniKernel) and torch.equal(linear.dense_weight(), expected)


@pytest.mark.skipif(not VNNI, reason="the VNNI kernel needs AVX512-VNNI")
@pytest.mark.parametrize("qtype", NEW_TYPES)
@pytest.mark.parametrize("input_bits", [8, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])  # 13: a pass of 8 and one of 5, on the kernel itself (no dense copy)
def test_q5_and_k_quant_linears_match_the_gguf_dequantized_reference(qtype, input_bits, dtype, rows):
    weight = _random_weight(qtype)
    reference = weight.dequantize()
    linear = QuantizedLinear(quant.kernel_weight([weight], "auto"), None, dtype, input_bits=input_bits)
    assert isinstance(linear.kernel, VnniKernel) and linear.format == ("int5" if qtype in (Q.Q5_0, Q.Q5_1) else qtype.name.lower())
    x = torch.randn(rows, K_SUPER).to(dtype)
    got = linear(x).float()
    assert got.shape == (rows, N) and linear(x).dtype == dtype
    assert ((got - x.float() @ reference.T).abs() <= _bound(linear, reference, x, input_bits)).all()


@pytest.mark.skipif(not VNNI, reason="the VNNI kernel needs AVX512-VNNI")
@pytest.mark.parametrize("qtype", NEW_TYPES)
def test_a_q5_or_k_quant_row_gives_the_same_bits_alone_and_among_other_rows(qtype):
    """Batch invariance, as for Q4/Q8 above: each row of a 2- to 11-row input is bit-equal to it alone."""
    linear = QuantizedLinear(quant.kernel_weight([_random_weight(qtype)], "auto"), None, torch.bfloat16)
    x = torch.randn(11, K_SUPER).bfloat16()
    alone = torch.cat([linear.kernel(x[r:r + 1]) for r in range(len(x))])
    for rows in range(2, len(x) + 1):
        assert torch.equal(linear.kernel(x[:rows]), alone[:rows]), rows


@pytest.mark.skipif(not VNNI, reason="the VNNI kernel needs AVX512-VNNI")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, *NEW_TYPES])
@pytest.mark.parametrize("input_bits", [8, 16])
def test_row_segments_through_their_own_weights_give_each_row_the_bits_it_gets_alone(qtype, input_bits):
    """`quant_linear_segments` (a mixture's chosen experts over the rows routed to them) equals each
    segment's rows through its weight alone, bit for bit: an empty segment included, and one of 9 rows
    (two passes of a panel, which take a 5- or 6-bit panel's operands unpacked once)."""
    kernels = [QuantizedLinear(quant.kernel_weight([_random_weight(qtype, seed=seed)], "auto"), None, torch.bfloat16, input_bits=input_bits).kernel
               for seed in range(4)]
    counts = [3, 0, 9, 1]
    x = torch.randn(sum(counts), K_SUPER).bfloat16()
    got = cpu_kernels.quant_linear_segments(x, [k.packed for k in kernels], [k.scales for k in kernels], counts, kernels[0].bits,
                                            input_bits, kernels[0].scheme)
    firsts = np.cumsum([0, *counts[:-1]])
    assert torch.equal(got, torch.cat([kernel(x[first:first + count]) for kernel, first, count in zip(kernels, firsts, counts)]))
    with pytest.raises(RuntimeError, match="add up to 12, x has 13 rows"):
        cpu_kernels.quant_linear_segments(x, [k.packed for k in kernels], [k.scales for k in kernels], [3, 0, 8, 1], kernels[0].bits,
                                          input_bits, kernels[0].scheme)


def test_without_vnni_q4_k_runs_on_torchs_int4_kernel_and_the_other_new_types_fit_no_kernel(monkeypatch):
    """On a CPU without AVX512-VNNI, Q4_K runs where Q4_0 does (torch's int4 kernel, d sc and dmin m as
    its scale and offset); int5, Q5_K and Q6_K have no kernel there (the model dequantizes them)."""
    monkeypatch.setattr(cpu_kernels, "has_avx512_vnni", lambda: False)
    weight = _random_weight(Q.Q4_K)
    reference = weight.dequantize()
    linear = QuantizedLinear(quant.kernel_weight([weight], "auto"), None, torch.bfloat16)
    assert isinstance(linear.kernel, TorchInt4Kernel)
    x = torch.randn(3, K_SUPER).bfloat16()
    assert ((linear(x).float() - x.float() @ reference.T).abs() <= _bound(linear, reference, x)).all()
    for qtype in (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K):
        assert not fits(quant.kernel_weight([_random_weight(qtype)], "auto"))


def test_fused_parts_of_mixed_types_meet_in_the_narrowest_exact_format_or_run_side_by_side():
    """Q4_K_M files mix types within one fused linear (q/k Q5_0 beside v Q8_0; Q4_K beside Q6_K)."""
    def check(parts, name):
        kernel = quant.kernel_weight(parts, "auto")
        assert quant.format_name(kernel) == name
        if VNNI:
            linear = QuantizedLinear(kernel, None, torch.float32)
            reference = torch.cat([p.dequantize() for p in parts])
            assert torch.equal(linear.dense_weight(), reference)
            x = torch.randn(11, reference.shape[1])
            assert ((linear(x) - x @ reference.T).abs() <= _bound(linear, reference, x, 16) + 1e-5 * (x.abs() @ reference.abs().T)).all()
            alone = torch.cat([linear(x[r:r + 1]) for r in range(len(x))])
            assert torch.equal(linear(x), alone)  # batch invariance: without a dense copy the kernel takes every row count

    q4_0, q4_1, q5_0, q5_1, q8_0 = (_gguf_weight(t) for t in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0))
    check([q4_1, q5_1], "int5")
    check([q5_0, q4_0, q8_0], "int8")  # symmetric blocks are int8 values
    check([q5_1, q8_0], "int5+int8")  # Q5_1's minimum: no int8 values
    q4_k, q5_k, q6_k = (_random_weight(t, seed=i) for i, t in enumerate((Q.Q4_K, Q.Q5_K, Q.Q6_K)))
    check([q4_k, q5_k], "q5_k")
    check([q4_k, q4_k, q6_k], "q4_k+q6_k")


@pytest.mark.parametrize("gated", [False, True])
def test_the_dense_companion_runs_any_row_count_on_its_one_amx_copy(gated):
    """``Linear(one_copy=True)`` (a quantized linear's dense copy) holds only the AMX copy and runs
    inputs of more than 64 rows on it 64 at a time, as oneDNN would compute them."""
    from stageserve.device.kernels import cpu_kernels
    from stageserve.device.model.linear import Linear

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
