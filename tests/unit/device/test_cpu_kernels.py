"""The fused CPU ops (``cpu_kernels``): on an AVX-512 CPU they load and a model step runs through
them; each gives what the model's plain torch ops give, and the model agrees with itself either way."""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from stageserve.device.kernels import cpu_kernels
from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.forward_batch import ForwardBatch, build_forward_batch
from stageserve.device.model.decoder import DecoderModel
from stageserve.device.model.rope import apply_rope, rope_tables
from stageserve.device.model.weights import load_weights
from stageserve.model_files import embedded_model_path


def os_grants_amx_tiles() -> bool:
    """Whether Linux hands this process the AMX tile data state, asked as the kernels and oneDNN ask
    (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, Linux 5.16+)."""
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18  # x86-64 numbers
    return ctypes.CDLL(None, use_errno=True).syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0


# What this CPU offers, read from the OS rather than from cpu_kernels' own checks, which are under test.
CPU_FLAGS = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
HAS_AVX512 = platform.machine() == "x86_64" and {"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"} <= CPU_FLAGS
HAS_VNNI = HAS_AVX512 and "avx512_vnni" in CPU_FLAGS
HAS_AMX = HAS_AVX512 and {"avx512_bf16", "amx_tile", "amx_bf16"} <= CPU_FLAGS and os_grants_amx_tiles()
needs_avx512_cpu = pytest.mark.skipif(not HAS_AVX512, reason="the kernels are built only for x86-64 CPUs with AVX-512 (F/BW/DQ/VL)")

KERNELS_LOADED = cpu_kernels.load_cpu_kernels()
needs_kernels = pytest.mark.skipif(
    not KERNELS_LOADED, reason=f"CPU kernels not loaded ({cpu_kernels.unavailable_reason()}); on an AVX-512 CPU test_kernels_load_on_an_avx512_cpu fails"
)
needs_amx = pytest.mark.skipif(not (KERNELS_LOADED and torch.ops.stageserve.has_amx()), reason="amx_linear needs a CPU with AMX-BF16 that Linux grants")


def reference(
    q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Float64 attention of each row over its context (its last ``window`` tokens), gathered token by
    token from the pool; with ``softcap``, scores capped as transformers' ``eager_attention_forward`` does."""
    kv_heads, _, block_size, d = pool.shape[0] // 2, *pool.shape[1:]
    rows, heads = q.shape[:2]
    out = torch.empty(rows, heads * d, dtype=torch.float64)
    for b in range(rows):
        n = int(lens[b])
        first = 0 if window is None else max(0, n - window)
        slots = [(int(tables[b, t // block_size]), t % block_size) for t in range(first, n)]
        k = torch.stack([pool[:kv_heads, blk, off] for blk, off in slots], 1).double()  # [K, n, D]
        v = torch.stack([pool[kv_heads:, blk, off] for blk, off in slots], 1).double()
        qb = q[b].double().view(kv_heads, heads // kv_heads, d)  # [K, G, D]
        scores = qb @ k.transpose(1, 2) * scale  # [K, G, n]
        p = (scores if softcap is None else torch.tanh(scores / softcap) * softcap).softmax(-1)
        out[b] = (p @ v).reshape(-1)
    return out


@needs_avx512_cpu
def test_kernels_load_on_an_avx512_cpu():
    """On an AVX-512 CPU the kernels must build and load, a C++ compiler being part of the set-up
    (README): the model's fallback to plain torch is for users, and in the test suite it would let
    the fused-versus-torch tests compare torch with torch and pass. They suit the embedded model
    (bf16 and fp32, 3 query heads per kv head), and the AMX linears are on exactly where the CPU has
    AMX-BF16 and Linux grants its tiles."""
    assert KERNELS_LOADED, f"the CPU kernels did not load on this AVX-512 CPU: {cpu_kernels.unavailable_reason()}"
    assert cpu_kernels.unavailable_reason() is None and cpu_kernels.library_path().exists()
    for dtype in (torch.bfloat16, torch.float32):
        assert cpu_kernels.available(dtype, 64, 3)
    assert not cpu_kernels.available(torch.float16, 64, 3)
    assert not cpu_kernels.available(torch.float32, 48, 3)  # head_dim must be 64 or 128
    assert not cpu_kernels.available(torch.float32, 64, 9)  # at most 8 query heads per kv head
    assert torch.ops.stageserve.has_amx() == HAS_AMX
    assert cpu_kernels.has_avx512_vnni() == HAS_VNNI


def fused_op_calls(run: Callable[[], object]) -> dict[str, int]:
    """How many times each ``torch.ops.stageserve`` op ran during ``run()``, counted by torch's
    profiler (which records every op the dispatcher runs)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    return {event.key.removeprefix("stageserve::"): event.count for event in profile.key_averages() if event.key.startswith("stageserve::")}


@needs_avx512_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_step_runs_through_the_fused_ops(dtype):
    """The embedded model's mixed step (19 tokens, 3 decode rows) runs every decoder layer through
    the fused ops: one RMSNorm, then per layer RoPE with the KV store, paged decode attention, two
    residual adds with the next RMSNorm (the last layer's second add is plain) and SwiGLU. In bfloat16
    on a CPU with AMX (granted by Linux) its linears run on ``amx_linear`` (qkv, o and down of each
    layer, and the lm head) and SwiGLU on ``amx_swiglu``; otherwise on oneDNN, then ``silu_and_mul``."""
    config, weights = load_weights(embedded_model_path(), dtype)
    model = DecoderModel(config, weights, "cpu")
    on_amx = dtype == torch.bfloat16 and HAS_AMX
    assert model.cpu_kernels, f"the model runs plain torch ops: {cpu_kernels.unavailable_reason()}"
    assert model.amx_linears == on_amx
    batch, cache = mixed_step(model, dtype)
    layers = config.num_layers
    expected = {"rms_norm": 1, "rope_and_cache": layers, "paged_decode_attention": layers, "add_rms_norm": 2 * layers - 1}
    expected |= {"amx_linear": 3 * layers + 1, "amx_swiglu": layers} if on_amx else {"silu_and_mul": layers}
    assert fused_op_calls(lambda: model.forward(batch, cache)) == expected


@pytest.mark.skipif(not HAS_VNNI, reason="quant_linear needs AVX512-VNNI")
def test_quantized_decode_step_runs_every_linear_on_quant_linear():
    """``--weights auto`` on a VNNI CPU: a one-row decode step of the embedded Q4_1 model looks its
    token up in the tied int8 table (``quant_rows``), runs its layers in one ``decode_layers`` call
    (which takes only layers whose linears are all on the kernel: test_fused_decode.py) and the int8
    head on ``quant_linear``; without that call, its 120 layer linears and the head on
    ``quant_linear``, and none on AMX or oneDNN either way."""
    model = DecoderModel.from_path(embedded_model_path(), torch.bfloat16, "cpu", weight_format="auto")
    cache = PagedKVCache(model.config, 4, 16, torch.bfloat16, "cpu")
    model.forward(build_forward_batch([([1, 2, 3], 0, [1], True)], 16, "cpu"), cache)
    calls = fused_op_calls(lambda: model.forward(build_forward_batch([([4], 3, [1], True)], 16, "cpu"), cache))
    assert calls == {"quant_rows": 1, "decode_layers": 1, "quant_linear": 1}
    model.fused_decode = None
    calls = fused_op_calls(lambda: model.forward(build_forward_batch([([5], 4, [1], True)], 16, "cpu"), cache))
    assert calls["quant_linear"] == 4 * model.config.num_layers + 1
    assert "amx_linear" not in calls and "amx_swiglu" not in calls


@pytest.mark.skipif(not HAS_VNNI, reason="quant_linear needs AVX512-VNNI")
def test_quant_linear_refuses_what_it_cannot_run():
    packed, scales = torch.zeros(2, 2, 256, dtype=torch.uint8), torch.zeros(2, 2, 2, 16, dtype=torch.float16)
    assert cpu_kernels.quant_linear(torch.zeros(0, 64), packed, scales, 4).shape == (0, 32)
    with pytest.raises(RuntimeError, match="bits 2 do not go with scheme 0"):
        cpu_kernels.quant_linear(torch.zeros(1, 64), packed, scales, 2)
    with pytest.raises(RuntimeError, match="bits 4 do not go with scheme 2"):  # Q6_K's scheme is 6-bit
        cpu_kernels.quant_linear(torch.zeros(1, 64), packed, scales, 4, 16, 2)
    with pytest.raises(RuntimeError, match="scheme must be 0"):
        cpu_kernels.quant_linear(torch.zeros(1, 64), packed, scales, 4, 16, 4)
    with pytest.raises(RuntimeError, match="scales must be float16"):  # d and m where the symmetric scheme holds d alone
        cpu_kernels.quant_linear(torch.zeros(1, 64), packed, scales, 4, 16, 3)
    with pytest.raises(RuntimeError, match="K must be a multiple of 256"):  # K-quant super-blocks
        cpu_kernels.quant_linear(torch.zeros(1, 64), packed, torch.zeros(2, 1, 320, dtype=torch.uint8), 4, 16, 1)
    with pytest.raises(RuntimeError, match="input_bits must be 8 or 16"):
        cpu_kernels.quant_linear(torch.zeros(1, 64), packed, scales, 4, 4)
    with pytest.raises(RuntimeError, match="packed must be uint8"):
        cpu_kernels.quant_linear(torch.zeros(1, 96), packed, scales, 4)  # 3 groups of inputs, 2 packed
    with pytest.raises(RuntimeError, match="packed must be uint8"):
        cpu_kernels.quant_linear(torch.zeros(1, 64), packed, scales, 8)  # an int4 layout read as int8
    with pytest.raises(RuntimeError, match="scales must be float16"):
        cpu_kernels.quant_linear(torch.zeros(1, 64), packed, scales.float(), 4)
    with pytest.raises(RuntimeError, match="scales must be float16"):  # K-quant scales of the wrong size
        cpu_kernels.quant_linear(torch.zeros(1, 256), torch.zeros(2, 8, 256, dtype=torch.uint8), torch.zeros(2, 1, 288, dtype=torch.uint8), 4, 16, 1)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_kernels.quant_linear(torch.zeros(1, 64).half(), packed, scales, 4)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "group", "block_size"), [(64, 3, 16), (64, 1, 4), (128, 8, 16), (64, 7, 8), (128, 2, 32)])
def test_matches_reference_over_scattered_blocks(dtype, head_dim, group, block_size):
    """Contexts of 1 token, inside a block, on and across block edges and long; shuffled blocks; the
    pool's other blocks hold large garbage that must never be read. fp32 within 2e-5, bf16 within
    bf16 rounding of the output (the kernel accumulates in fp32)."""
    g = torch.Generator().manual_seed(head_dim * group + block_size)
    kv_heads, lens = 2, torch.tensor([1, block_size - 1, block_size, block_size + 1, 5 * block_size + 3, 300])
    width = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * width + 5
    pool = torch.randn(2 * kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: len(lens) * width].view(len(lens), width).contiguous()
    owned = torch.zeros(num_blocks, dtype=torch.bool)
    for b, n in enumerate(lens.tolist()):
        owned[tables[b, : -(-n // block_size)]] = True
    pool[:, ~owned] = 1e4  # read by mistake, it would dominate the softmax
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    out = cpu_kernels.paged_decode_attention(q, pool, tables, lens, scale)
    assert out.shape == (len(lens), kv_heads * group * head_dim) and out.dtype == dtype
    expected = reference(q, pool, tables, lens, scale)
    tolerance = 2e-5 if dtype == torch.float32 else 8e-3
    assert (out.double() - expected).abs().max().item() < tolerance


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 16, 19, 1000])
def test_a_sliding_window_reads_only_the_rows_last_tokens(dtype, window):
    """Each row attends to its last ``window`` tokens (transformers' ``q - k < window``): the blocks
    before its window may name no block of the pool at all (id -1) and are not read; a window as
    long as the context gives exactly what no window gives."""
    g = torch.Generator().manual_seed(window)
    block_size, lens = 16, torch.tensor([1, 15, 16, 17, 40, 100])
    width = -(-int(lens.max()) // block_size)
    pool = torch.randn(4, len(lens) * width, block_size, 64, generator=g).to(dtype)  # 2 kv heads
    tables = torch.randperm(len(lens) * width, generator=g).view(len(lens), width).contiguous()
    for b, n in enumerate(lens.tolist()):
        tables[b, : max(0, n - window) // block_size] = -1
    q = torch.randn(len(lens), 4, 64, generator=g).to(dtype)
    out = cpu_kernels.paged_decode_attention(q, pool, tables, lens, 0.125, window)
    tolerance = 2e-5 if dtype == torch.float32 else 8e-3
    assert (out.double() - reference(q, pool, tables.clamp(min=0), lens, 0.125, window)).abs().max().item() < tolerance
    if window >= int(lens.max()):
        assert torch.equal(out, cpu_kernels.paged_decode_attention(q, pool, tables, lens, 0.125))
    else:  # without the window those blocks would be read: refused
        with pytest.raises(RuntimeError, match="block id -1 outside the pool"):
            cpu_kernels.paged_decode_attention(q, pool, tables, lens, 0.125)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_capped_scores_give_transformers_attention(dtype):
    """Gemma 2's ``attn_logit_softcapping``: each scaled score s becomes ``cap * tanh(s / cap)`` before
    the softmax, with and without a window; scores large enough that the cap changes the output."""
    g = torch.Generator().manual_seed(3)
    lens = torch.tensor([1, 17, 40, 100])
    pool = torch.randn(4, 4 * 7, 16, 64, generator=g)  # 2 kv heads
    pool = torch.cat((3 * pool[:2], pool[2:])).to(dtype)  # keys x3: scores reach ~ +-30, values as before
    tables = torch.randperm(4 * 7, generator=g).view(4, 7).contiguous()
    q = (3 * torch.randn(4, 4, 64, generator=g)).to(dtype)
    tolerance = 2e-5 if dtype == torch.float32 else 8e-3
    for window in (None, 19):
        out = cpu_kernels.paged_decode_attention(q, pool, tables, lens, 0.125, window, softcap=5.0)
        assert (out.double() - reference(q, pool, tables, lens, 0.125, window, softcap=5.0)).abs().max().item() < tolerance
        assert (out.double() - reference(q, pool, tables, lens, 0.125, window)).abs().max().item() > 0.1


@needs_kernels
def test_reads_q_through_its_strides():
    """``q`` may be a view (the model passes a slice of the fused q/k/v projection)."""
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(2, 4, 16, 64, generator=g)
    qkv = torch.randn(3, 5, 64, generator=g)  # 3 query heads + 2 more per row, then sliced
    q = qkv[:, :3]
    tables, lens = torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.tensor([20, 3, 32])
    assert not q.is_contiguous()
    out = cpu_kernels.paged_decode_attention(q, pool, tables, lens, 0.125)
    assert (out.double() - reference(q, pool, tables, lens, 0.125)).abs().max().item() < 2e-5


@needs_kernels
@pytest.mark.parametrize(
    ("tables", "lens", "message"),
    [
        (torch.tensor([[0, 9]]), torch.tensor([20]), "block id 9 outside the pool"),
        (torch.tensor([[0, 1]]), torch.tensor([33]), "context 33 outside 1..32"),
        (torch.tensor([[0, 1]]), torch.tensor([0]), "context 0 outside"),
        (torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([3]), "block_tables must be contiguous int64"),
    ],
)
def test_refuses_out_of_bounds_input(tables, lens, message):
    """Bad tables or lengths raise a RuntimeError naming the problem instead of reading outside the pool."""
    pool, q = torch.zeros(2, 4, 16, 64), torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.paged_decode_attention(q, pool, tables, lens, 0.125)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    """Within fp32 rounding, or for bf16 within two bf16 steps of the expected value's size."""
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    return bool(((actual.double() - expected.double()).abs() <= tolerance * (1 + expected.double().abs())).all())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 49152])  # masked tails, one full vector, a vocabulary
def test_argmax_rows_matches_torch_max(dtype, n):
    """The first index of each row's maximum, as ``torch.max(x, -1).indices``: ties, a row of -inf,
    NaN (the first one wins, as torch's), a maximum in the last (masked) lane, strided rows."""
    x = torch.randn(40, n, generator=torch.Generator().manual_seed(n)).to(dtype)
    x[1] = float("-inf")
    x[2, -1] = 1e4
    if n > 4:
        x[3, [1, n - 2]] = 1e4
        x[4, [2, 4]] = float("nan")
        x[5, [0, 3]] = float("inf")
    expected = x.float().max(-1).indices
    assert torch.equal(cpu_kernels.argmax_rows(x), expected)
    assert torch.equal(cpu_kernels.argmax_rows(x[::3]), expected[::3])  # rows further apart than n


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 17, 49152])
def test_gumbel_argmax_draws_the_tokens_of_the_samplers_torch_ops(dtype, n):
    """The fused draw against the sampler's own torch ops (scale, clamp, cutoff, counter-based noise,
    argmax) on 64 rows with random temperatures, seeds (negative ones too: uint64 seeds wrap) and
    steps, with and without cutoffs: the same token on every row."""
    from stageserve.device.sampler import _log_exponential_noise

    generator = torch.Generator().manual_seed(n)
    logits = (torch.randn(64, n, generator=generator) * 3).to(dtype)
    logits[0] = float("-inf")
    logits[1, -1] = float("nan")
    temperature = torch.rand(64, generator=generator) + 0.05
    seed = torch.randint(-2**62, 2**62, (64,), generator=generator)
    step_index = torch.randint(0, 10_000, (64,), generator=generator)
    for cutoff in (None, torch.randn(64, generator=generator)):
        scaled = (logits.float() / temperature.unsqueeze(1)).clamp_(-torch.finfo(torch.float32).max, torch.finfo(torch.float32).max)
        if cutoff is not None:
            scaled.masked_fill_(scaled < cutoff.unsqueeze(1), float("-inf"))
        expected = (scaled - _log_exponential_noise(seed, step_index, n)).max(-1).indices
        assert torch.equal(cpu_kernels.gumbel_argmax(logits, temperature, cutoff, seed, step_index), expected)


@needs_kernels
def test_argmax_rows_refuses_other_layouts():
    with pytest.raises(RuntimeError, match="contiguous rows"):
        cpu_kernels.argmax_rows(torch.randn(4, 8).t())
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.argmax_rows(torch.randn(4, 8).half())
    with pytest.raises(RuntimeError, match="1 to"):
        cpu_kernels.argmax_rows(torch.empty(4, 0))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [7, 49152, 49161])  # within one store; the model's vocabulary; a part-used last word
def test_apply_token_bitmask_matches_xgrammar(dtype, n):
    """-inf exactly where xgrammar's own kernel puts it, on the chosen rows only (the others keep
    their values), for random bitmasks whose last word may cover fewer tokens than 32."""
    import xgrammar

    generator = torch.Generator().manual_seed(n)
    words = (n + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (6, words), dtype=torch.int32, generator=generator)
    bitmask[4] = -1  # every token allowed
    bitmask[5] = 0  # none
    logits = torch.randn(6, n, generator=generator).to(dtype)
    expected = logits.clone()
    rows = [0, 2, 4, 5]
    xgrammar.apply_token_bitmask_inplace(expected, bitmask, indices=rows, backend="cpu")
    cpu_kernels.apply_token_bitmask_(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[5]).all() and not torch.isinf(logits[[1, 3, 4]]).any()


@needs_kernels
def test_apply_token_bitmask_refuses_a_bad_row_or_mask():
    logits = torch.zeros(2, 64)
    with pytest.raises(RuntimeError, match="outside the 2 rows"):
        cpu_kernels.apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int32), [2])
    with pytest.raises(RuntimeError, match="int32"):
        cpu_kernels.apply_token_bitmask_(logits, torch.zeros(2, 2, dtype=torch.int64), [0])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 32, 300])  # 300: enough rows to split over threads
def test_norms_and_swiglu_match_torch(dtype, rows):
    """rms_norm, add_rms_norm (residual updated in place) and silu_and_mul against the torch ops the
    model uses otherwise, on a hidden size that is not a multiple of 16 (masked tail)."""
    g = torch.Generator().manual_seed(rows)
    hidden, eps = 584, 1e-5
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    reference = lambda t: torch.nn.functional.rms_norm(t.float(), (hidden,), weight.float(), eps)  # noqa: E731
    assert _close(cpu_kernels.rms_norm(x, weight, eps), reference(x), dtype)
    residual = x.clone()
    h = cpu_kernels.add_rms_norm(residual, delta, weight, eps)
    assert torch.equal(residual, x + delta)  # the sum, rounded to the dtype as torch rounds it
    assert _close(h, reference(x + delta), dtype)
    gate_up = torch.randn(rows, 2 * 200, generator=g).mul(4).to(dtype)
    gate, up = gate_up.float().chunk(2, -1)
    assert _close(cpu_kernels.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "heads", "kv_heads", "head_dim"), [(1, 9, 3, 64), (300, 16, 8, 128), (5, 4, 1, 72)])  # 72: a masked tail
def test_rms_norm_heads_matches_per_head_rms_norm_and_leaves_values(dtype, rows, heads, kv_heads, head_dim):
    """Each query head normed by q_weight, each key head by k_weight (Qwen3's q_norm / k_norm), in
    place, within one rounding of torch's rms_norm per head; the values' columns are untouched."""
    g = torch.Generator().manual_seed(rows + head_dim)
    eps, d = 1e-6, head_dim
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).mul(3).to(dtype)
    q_weight, k_weight = ((1 + 0.2 * torch.randn(d, generator=g)).to(dtype) for _ in range(2))
    before = qkv.clone()
    cpu_kernels.rms_norm_heads_(qkv, q_weight, k_weight, heads, kv_heads, eps)
    norm = lambda t, w: torch.nn.functional.rms_norm(t.float(), (d,), w.float(), eps)  # noqa: E731
    q, k = before[:, : heads * d].view(rows, heads, d), before[:, heads * d : (heads + kv_heads) * d].view(rows, kv_heads, d)
    assert _close(qkv[:, : heads * d].view(rows, heads, d), norm(q, q_weight), dtype)
    assert _close(qkv[:, heads * d : (heads + kv_heads) * d].view(rows, kv_heads, d), norm(k, k_weight), dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], before[:, (heads + kv_heads) * d :])
    with pytest.raises(RuntimeError, match="qkv must be contiguous"):
        cpu_kernels.rms_norm_heads_(qkv[:, : -d], q_weight, k_weight, heads, kv_heads, eps)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
def test_rope_and_cache_matches_rope_then_store(dtype, heads, kv_heads, head_dim):
    """Rotated q/k heads equal ``apply_rope``'s; keys and values land in the named slots of the pool
    and every other slot is untouched."""
    from stageserve.device.model.config import ModelConfig

    g = torch.Generator().manual_seed(head_dim)
    config = ModelConfig(
        architecture="llama", vocab_size=10, hidden_size=heads * head_dim, intermediate_size=1, num_layers=1, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=None, eos_token_ids=(0,),
    )
    cos, sin = rope_tables(config, dtype, "cpu")
    tokens = 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    pool = torch.randn(2 * kv_heads, 8, 16, head_dim, generator=g).to(dtype)
    slots = torch.randperm(8 * 16, generator=g)[:tokens]
    before = pool.clone()
    qk = cpu_kernels.rope_and_cache(qkv, cos, sin, positions, pool, slots, heads)
    expected = apply_rope(qkv[:, : (heads + kv_heads) * head_dim].float().view(tokens, -1, head_dim), cos[positions].float()[:, None], sin[positions].float()[:, None])
    assert qk.shape == (tokens, heads + kv_heads, head_dim) and _close(qk, expected, dtype)
    flat = pool.view(2 * kv_heads, -1, head_dim)
    assert torch.equal(flat[:kv_heads, slots], qk[:, heads:].transpose(0, 1))
    assert torch.equal(flat[kv_heads:, slots], qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim).transpose(0, 1))
    untouched = torch.ones(8 * 16, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], before.view(2 * kv_heads, -1, head_dim)[:, untouched])


@needs_kernels
def test_rope_and_cache_refuses_a_slot_outside_the_pool():
    """A slot or position out of range raises before anything is written."""
    pool = torch.zeros(2, 2, 16, 64)
    qkv = torch.zeros(1, 3 * 64)
    cos = torch.ones(8, 64)
    with pytest.raises(RuntimeError, match="slot 32 outside the pool of 32"):
        cpu_kernels.rope_and_cache(qkv, cos, cos, torch.tensor([0]), pool, torch.tensor([32]), 1)
    with pytest.raises(RuntimeError, match="position 8 outside the RoPE table of 8"):
        cpu_kernels.rope_and_cache(qkv, cos, cos, torch.tensor([8]), pool, torch.tensor([0]), 1)
    assert not pool.any()


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 64])  # partial and full 16-row tiles, 1 to 4 of them
@pytest.mark.parametrize(("n", "k"), [(16, 32), (960, 576), (576, 1536)])
def test_amx_linear_matches_matmul(rows, n, k):
    """x @ W.T (+ bias) within bf16 rounding of a float64 matmul of the same bf16 values, x read
    through a row stride; the packed copy is built by amx_pack from the plain weight."""
    g = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, k + 8, generator=g).bfloat16()[:, :k]  # rows further apart than k
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    assert cpu_kernels.amx_ready(w)
    expected = x.double() @ w.double().t()
    for b, want in ((None, expected), (bias, expected + bias.double())):
        got = cpu_kernels.amx_linear(x, cpu_kernels.amx_pack(w), b)
        assert got.shape == (rows, n) and got.dtype == torch.bfloat16
        assert ((got.double() - want).abs() <= 8e-3 * (want.abs() + 0.1)).all()


@needs_amx
@pytest.mark.parametrize("rows", [1, 16, 17, 64])
@pytest.mark.parametrize(("i", "k"), [(16, 32), (1536, 576)])
def test_amx_swiglu_matches_silu_of_matmul(rows, i, k):
    """silu(x @ gate.T) * (x @ up.T) from the gated packing, within bf16 rounding of float64."""
    g = torch.Generator().manual_seed(rows + i)
    x = torch.randn(rows, k, generator=g).bfloat16()
    gate_up = (torch.randn(2 * i, k, generator=g) * 0.05).bfloat16()
    assert cpu_kernels.amx_ready(gate_up, gated=True)
    gate, up = (x.double() @ gate_up.double().t()).chunk(2, -1)
    expected = torch.nn.functional.silu(gate) * up
    got = cpu_kernels.amx_swiglu(x, cpu_kernels.amx_pack_gated(gate_up))
    assert got.shape == (rows, i) and got.dtype == torch.bfloat16
    assert ((got.double() - expected).abs() <= 8e-3 * (expected.abs() + 0.1)).all()
    assert not cpu_kernels.amx_ready(torch.zeros(48, k, dtype=torch.bfloat16), gated=True)  # 24 + 24 rows: not whole tiles


@needs_amx
def test_amx_linear_takes_no_rows_and_refuses_what_it_cannot_run():
    w = cpu_kernels.amx_pack(torch.randn(32, 64).bfloat16())
    assert cpu_kernels.amx_linear(torch.empty(0, 64, dtype=torch.bfloat16), w).shape == (0, 32)
    with pytest.raises(RuntimeError, match="at most 64 rows"):
        cpu_kernels.amx_linear(torch.randn(65, 64).bfloat16(), w)
    with pytest.raises(RuntimeError, match="x has 32 inputs"):
        cpu_kernels.amx_linear(torch.randn(4, 32).bfloat16(), w)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_kernels.amx_linear(torch.randn(4, 64), w)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_kernels.amx_linear(torch.randn(4, 64).bfloat16(), w, torch.zeros(31, dtype=torch.bfloat16))
    assert not cpu_kernels.amx_ready(torch.randn(24, 64).bfloat16())  # 24 columns: not whole tiles
    assert not cpu_kernels.amx_ready(torch.randn(32, 64))  # float32


def mixed_step(model: DecoderModel, dtype: torch.dtype) -> tuple[ForwardBatch, PagedKVCache]:
    """One mixed step: decode rows of several lengths, a fresh prefill and a later prefill chunk,
    over scattered blocks (the same random tokens and tables for every model), and its KV cache
    holding the earlier tokens of its rows."""
    g = torch.Generator().manual_seed(0)
    rows = [(37, 1), (3, 1), (16, 1), (0, 9), (20, 7)]  # (tokens cached, new tokens)
    cache = PagedKVCache(model.config, 32, 16, dtype, "cpu")
    tables = [torch.randperm(32, generator=g)[:4].tolist() for _ in rows]
    step = []
    for (cached, new), table in zip(rows, tables):
        tokens = torch.randint(3, 49152, (cached + new,), generator=g).tolist()
        if cached:
            model.forward(build_forward_batch([(tokens[:cached], 0, table, False)], 16, "cpu"), cache)
        step.append((tokens[cached:], cached, table, True))
    return build_forward_batch(step, 16, "cpu"), cache


def mixed_step_logits(model: DecoderModel, dtype: torch.dtype) -> torch.Tensor:
    """Float32 logits ``[5, vocab]`` of ``mixed_step``."""
    return model.forward(*mixed_step(model, dtype)).float()


def test_model_fused_and_torch_paths_agree():
    """The embedded model's mixed step gives the same fp32 logits (< 1e-4) with the fused ops as in
    plain torch ops; where the kernels are unavailable (not on an AVX-512 CPU: see
    test_kernels_load_on_an_avx512_cpu) both are the torch path."""
    config, weights = load_weights(embedded_model_path(), torch.float32)
    fused, plain = DecoderModel(config, weights, "cpu"), DecoderModel(config, weights, "cpu", cpu_kernels_allowed=False)
    assert fused.cpu_kernels == cpu_kernels.available(torch.float32, 64, 3) and not plain.cpu_kernels
    assert (mixed_step_logits(fused, torch.float32) - mixed_step_logits(plain, torch.float32)).abs().max().item() < 1e-4


def test_bfloat16_model_stays_close_to_float32():
    """The embedded model in bf16 on its fastest path here (fused ops, decode-sized linears on AMX
    where the CPU has it) against plain fp32: logits within 1 (0.56 measured) and the same argmax;
    likewise with the AMX linears turned off."""
    config, weights = load_weights(embedded_model_path(), torch.bfloat16)
    model = DecoderModel(config, weights, "cpu")
    assert (model.layers[0].qkv.amx_weight is not None) == (model.cpu_kernels and cpu_kernels.amx_ready(weights["model.embed_tokens.weight"]))
    config32, weights32 = load_weights(embedded_model_path(), torch.float32)
    reference = mixed_step_logits(DecoderModel(config32, weights32, "cpu", cpu_kernels_allowed=False), torch.float32)
    logits = mixed_step_logits(model, torch.bfloat16)
    assert (logits - reference).abs().max().item() < 1.0
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))
    on_onednn = DecoderModel(config, weights, "cpu", amx_allowed=False)  # `stageserve device --no-amx-linears`
    assert not on_onednn.amx_linears and on_onednn.layers[0].qkv.amx_weight is None
    assert torch.equal(mixed_step_logits(on_onednn, torch.bfloat16).argmax(-1), reference.argmax(-1))


@needs_kernels
def test_nan_propagates_as_in_torch():
    """A NaN in a query or in one cached key makes that row's output NaN (as the torch path does)
    instead of being clamped away inside the softmax; other rows are unaffected."""
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(2, 4, 16, 64, generator=g)
    tables, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([20, 20])
    q = torch.randn(2, 1, 64, generator=g)
    q[0, 0, 5] = float("nan")
    out = cpu_kernels.paged_decode_attention(q, pool, tables, lens, 0.125)
    assert out[0].isnan().all() and not out[1].isnan().any()
    q[0, 0, 5] = 0.0
    pool[0, 3, 2, 7] = float("nan")  # a key of row 1 (block 3, token 18)
    out = cpu_kernels.paged_decode_attention(q.bfloat16(), pool.bfloat16(), tables, lens, 0.125)
    assert out[1].isnan().all() and not out[0].isnan().any()


@needs_kernels
def test_refuses_a_pool_without_heads():
    """A pool with no kv heads is a RuntimeError, not a division by zero in the process."""
    with pytest.raises(RuntimeError, match="kv must be a contiguous layer pool"):
        cpu_kernels.paged_decode_attention(torch.zeros(1, 1, 64), torch.zeros(0, 4, 16, 64), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long), 0.125)
    with pytest.raises(RuntimeError, match="kv must be a contiguous layer pool"):
        cpu_kernels.rope_and_cache(torch.zeros(1, 64), torch.ones(8, 64), torch.ones(8, 64), torch.zeros(1, dtype=torch.long), torch.zeros(0, 4, 16, 64), torch.zeros(1, dtype=torch.long), 1)
