"""Which quantized linears keep a dense copy (`dense_copies.choose`), and that one with a copy and
one without compute the same many-row input alike."""

from __future__ import annotations

import functools

import pytest
import torch

from stageserve.device.kernels import cpu_kernels, dense_copies, quant
from stageserve.device.model.linear import Linear
from stageserve.device.kernels.quant_linear import QuantizedLinear


def linear(n: int, k: int, seed: int = 0) -> QuantizedLinear:
    generator = torch.Generator().manual_seed(seed)
    weight = quant.int4_from_float(torch.randn(n, k, generator=generator) * 0.02)
    return QuantizedLinear(weight, None, torch.bfloat16, make_dense=Linear)


def test_copies_go_where_they_save_most_per_byte_within_the_budget():
    small = [linear(64, 64, i) for i in range(4)]  # 8 KiB copies, each saving 1 ms: 1/8 ms per KiB
    large = [linear(256, 128, i) for i in range(2)]  # 64 KiB copies, each saving 4 ms: 1/16 ms per KiB
    slower = [linear(128, 64, i) for i in range(2)]  # a copy slower than the kernel: never kept
    tie = [linear(16, 64, i) for i in range(2)]  # a copy that saves 5 %: a tie, never kept (2 KiB each)
    # A stand-in for the timer: real timings depend on the CPU, and the choice is what is under test here.
    ms = {(64, 64): (2.0, 1.0), (256, 128): (6.0, 2.0), (128, 64): (1.0, 1.5), (16, 64): (1.0, 0.95)}
    used = dense_copies.choose(small + large + slower + tie, budget_bytes=100 * 1024, timer=lambda lin, rows: ms[lin.shape])
    assert [lin.dense is not None for lin in small] == [True] * 4
    assert [lin.dense is not None for lin in large] == [True, False]  # 32 + 64 KiB fit in 100, 32 + 128 do not
    assert [lin.dense is not None for lin in tie] == [False] * 2  # 4 KiB were left
    assert [lin.dense is not None for lin in slower] == [False] * 2
    assert used == 4 * 64 * 64 * 2 + 256 * 128 * 2


def test_a_budget_of_nothing_keeps_no_copy_and_the_kernel_takes_every_row_count():
    lin = linear(64, 64)
    assert dense_copies.choose([lin], budget_bytes=0) == 0 and lin.dense is None
    x = torch.randn(40, 64).bfloat16()  # more rows than the kernel's max_rows
    without = lin(x)
    lin.keep_dense_copy()
    with_copy = lin(x)
    reference = x.float() @ lin.dense_weight().float().T
    for y in (without, with_copy):
        assert y.shape == (40, 64)
        assert (y.float() - reference).abs().max() <= 0.02 * reference.abs().max()


def test_the_real_timer_measures_both_paths_and_drops_the_copy_it_built():
    lin = linear(128, 64)
    kernel_ms, dense_ms = dense_copies.time_on_kernel_and_dense(lin, rows=32, repeats=2)
    assert kernel_ms > 0 and dense_ms > 0 and lin.dense is None


@pytest.mark.skipif(not cpu_kernels.load_cpu_kernels(), reason="a SwiGLU linear runs through the CPU kernels' silu_and_mul")
def test_the_real_timer_times_a_swiglu_linear_as_the_model_runs_it():
    """A gated [gate; up] linear's dense copy is AMX-only where the CPU has AMX (no plain product):
    the timer runs it, and the kernel, through swiglu as the decoder's fused MLP does."""
    generator = torch.Generator().manual_seed(0)
    weight = quant.int4_from_float(torch.randn(64, 64, generator=generator) * 0.02)
    lin = QuantizedLinear(weight, None, torch.bfloat16, make_dense=functools.partial(Linear, amx=True, gated=True, one_copy=True))
    kernel_ms, dense_ms = dense_copies.time_on_kernel_and_dense(lin, rows=32, repeats=2)
    assert kernel_ms > 0 and dense_ms > 0 and lin.dense is None


def test_the_first_timings_on_a_machine_are_every_later_process_s_choice(tmp_path):
    cache = tmp_path / "timings.json"
    faster_dense = {(64, 64): (2.0, 1.0)}
    slower_dense = {(64, 64): (1.0, 2.0)}
    first, later = [linear(64, 64)], [linear(64, 64)]
    dense_copies.choose(first, budget_bytes=1 << 20, timer=lambda lin, rows: faster_dense[lin.shape], cache=cache)
    # A later process times differently (a busy machine): it takes the cached timings instead.
    dense_copies.choose(later, budget_bytes=1 << 20, timer=lambda lin, rows: slower_dense[lin.shape], cache=cache)
    assert first[0].dense is not None and later[0].dense is not None
    assert cache.exists() and not list(tmp_path.glob("*.tmp"))


def test_the_cache_key_names_the_shapes_and_the_rows():
    a = dense_copies.cache_path([linear(64, 64)], rows=32)
    assert a == dense_copies.cache_path([linear(64, 64, seed=1)], rows=32)  # the weights' values do not matter
    assert a != dense_copies.cache_path([linear(128, 64)], rows=32)
    assert a != dense_copies.cache_path([linear(64, 64)], rows=16)
