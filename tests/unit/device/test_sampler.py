"""Unit tests of the device's batched sampler on hand-built logits (CPU, plus CUDA when present)."""

from __future__ import annotations

import math

import pytest
import torch

from stageserve.device.kernels import cpu_kernels
from stageserve.device.sampler import (
    SamplingTensors,
    _log_exponential_noise,
    apply_repetition_penalty,
    sample,
    validate_sampling_params,
)
from stageserve.sampling_rules import MAX_LOGPROBS
from stageserve.v1 import common_pb2
from tests.unit.device.sampling_tensors import tensors_from_lists

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# A 5-token distribution whose truncated sets are known: top_p 0.75 keeps {0, 1}, 0.85 keeps {0, 1, 2}.
FIVE_PROBS = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])


def make_tensors(
    rows: int,
    device: str,
    *,
    temperature: float | list[float] = 1.0,
    top_p: float | list[float] = 1.0,
    top_k: int | list[int] = 0,
    min_p: float | list[float] = 0.0,
    repetition_penalty: float | list[float] = 1.0,
    seed: int | list[int] | None = None,
    step_index: int | list[int] = 0,
    logprobs: int | list[int] = 0,
) -> SamplingTensors:
    """SamplingTensors for `rows` rows; scalars apply to every row, seeds default to 0..rows-1."""

    def per_row(value):
        return list(value) if isinstance(value, list) else [value] * rows

    return tensors_from_lists(
        temperature=per_row(temperature),
        top_p=per_row(top_p),
        top_k=per_row(top_k),
        min_p=per_row(min_p),
        repetition_penalty=per_row(repetition_penalty),
        seed=list(range(rows)) if seed is None else per_row(seed),
        step_index=per_row(step_index),
        logprobs=per_row(logprobs),
        device=device,
    )


def draw_counts(logits_row: torch.Tensor, draws: int, device: str, **params) -> torch.Tensor:
    """Token counts [V] over `draws` rows that share one logits row and differ only in seed."""
    logits = logits_row.to(device).expand(draws, -1).contiguous()
    token_ids = sample(logits, make_tensors(draws, device, **params)).token_ids
    return torch.bincount(token_ids.cpu(), minlength=logits_row.numel())


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("device", DEVICES)
def test_all_greedy_step_returns_argmax(device):
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1)).to(device)
    tensors = make_tensors(8, device, temperature=0.0)
    assert tensors.all_greedy
    result = sample(logits, tensors)
    assert torch.equal(result.token_ids, logits.argmax(dim=-1))
    assert result.token_ids.dtype == torch.int64
    assert result.logprobs is None and result.top_ids is None and result.top_logprobs is None


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_takes_the_first_of_tied_maxima(device):
    # A vocabulary-sized row, so a vectorised or multi-threaded reduction splits it into chunks.
    logits = torch.zeros(4, 49152)
    logits[0, [7, 100, 40000]] = 3.0
    logits[1, [30000, 49151]] = 1.0
    logits[2, :] = -2.0
    logits[3, [5, 6]] = float("inf")
    token_ids = sample(logits.to(device), make_tensors(4, device, temperature=0.0)).token_ids
    assert token_ids.tolist() == [7, 30000, 0, 5]


FUSED = [False] + ([True] if cpu_kernels.load_cpu_kernels() else [])  # True: the AVX-512 argmax of cpu_kernels


@pytest.mark.parametrize("fused", FUSED)
def test_bfloat16_logits_sample_as_their_float32_copy(fused):
    """The model hands over logits in its activation dtype: every path gives what the float32 copy
    gives (greedy reads bf16 as it is, the rest widens first), with the CPU argmax kernel or without."""
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(9)).mul(3).bfloat16()
    logits[0, [11, 40000]] = 20.0  # a tie: the first index
    presence = torch.rand(6, 49152, generator=torch.Generator().manual_seed(10)) < 0.1
    for params in ({"temperature": 0.0}, {"temperature": [0.0, 0.8, 0.0, 1.2, 0.0, 1.0], "top_p": 0.9},
                   {"temperature": 0.0, "repetition_penalty": 1.3, "logprobs": 3}):
        tensors = make_tensors(6, "cpu", **params)
        ours = sample(logits, tensors, presence, fused_argmax=fused)
        reference = sample(logits.float(), tensors, presence)
        assert torch.equal(ours.token_ids, reference.token_ids), params
        if ours.logprobs is not None:
            assert torch.equal(ours.logprobs, reference.logprobs) and torch.equal(ours.top_ids, reference.top_ids)
    assert sample(logits, make_tensors(6, "cpu", temperature=0.0), fused_argmax=fused).token_ids[0] == 11


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_in_a_sampled_batch_return_argmax(device):
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(2)).to(device)
    tensors = make_tensors(6, device, temperature=[0.0, 1.5, 0.0, 0.7, 0.0, 1.0], top_p=0.9, min_p=0.01)
    assert not tensors.all_greedy
    token_ids = sample(logits, tensors).token_ids
    argmax = logits.argmax(dim=-1)
    assert torch.equal(token_ids[0::2], argmax[0::2])


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_one_equals_greedy(device):
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)).to(device)
    argmax = logits.argmax(dim=-1)
    from_lists = make_tensors(5, device, temperature=1.3, top_k=1)
    assert from_lists.all_greedy  # the builder turns top_k = 1 rows into greedy rows
    assert torch.equal(sample(logits, from_lists).token_ids, argmax)
    # The sampling path truncates to the single largest logit too.
    hand_built = make_tensors(5, device, temperature=1.3, top_k=2)
    hand_built.top_k = torch.ones(5, dtype=torch.int64, device=device)
    assert not hand_built.all_greedy and hand_built.any_top_k
    assert torch.equal(sample(logits, hand_built).token_ids, argmax)


def test_tiny_temperature_is_greedy():
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(4))
    tensors = make_tensors(4, "cpu", temperature=[0.0, 1e-7, 0.0, 1e-6])
    assert tensors.all_greedy
    assert torch.equal(sample(logits, tensors).token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("device", DEVICES)
def test_seed_reproduces_token_whatever_the_batch_around_it(device):
    vocab = 4096
    generator = torch.Generator().manual_seed(5)
    target_logits = (torch.randn(vocab, generator=generator) * 0.5).to(device)  # many plausible tokens
    targets = [(7, 0), (123456789, 3), (2**64 - 1, 100), (2**63, 41)]  # (seed, step_index)
    for seed, step_index in targets:
        alone = make_tensors(1, device, temperature=0.9, top_p=0.95, seed=seed, step_index=step_index)
        token_alone = sample(target_logits.unsqueeze(0), alone).token_ids.item()

        # Same row at position 11 of 16, among rows with other logits and every other stage in use.
        batch_logits = torch.randn(16, vocab, generator=generator).to(device)
        batch_logits[11] = target_logits
        batch = make_tensors(
            16,
            device,
            temperature=[0.0, 1.0, 0.5, 2.0] * 2 + [0.8, 1.2, 1.0, 0.9, 0.7, 0.0, 1.1, 1.0],
            top_p=[0.8] * 11 + [0.95] + [0.5] * 4,
            top_k=[40] * 11 + [0] + [10] * 4,
            min_p=[0.05] * 11 + [0.0] + [0.1] * 4,
            seed=list(range(100, 111)) + [seed] + list(range(4)),
            step_index=[step_index] * 16,
        )
        assert sample(batch_logits, batch).token_ids[11].item() == token_alone
        # The same call again: the same token.
        assert sample(target_logits.unsqueeze(0), alone).token_ids.item() == token_alone


def test_different_seeds_and_steps_draw_different_tokens():
    uniform_logits = torch.zeros(1000)
    by_seed = draw_counts(uniform_logits, 200, "cpu")
    # 200 draws from 1000 equally likely tokens: ~181 distinct expected.
    assert int((by_seed > 0).sum()) > 160
    logits = uniform_logits.expand(200, -1).contiguous()
    by_step = sample(logits, make_tensors(200, "cpu", seed=42, step_index=list(range(200)))).token_ids
    assert by_step.unique().numel() > 160


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_sampling_distribution_matches_softmax(device, temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    counts = draw_counts(logits, 20000, device, temperature=temperature)
    expected = torch.softmax(logits / temperature, dim=-1)
    # 5 degrees of freedom: P(chi2 > 30) ~ 1.5e-5; the seeds are fixed, so the test is deterministic.
    assert chi_square(counts, expected) < 30.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("top_p", "allowed"), [(0.75, 2), (0.85, 3), (1.0, 5)])
def test_top_p_draws_only_from_the_nucleus(device, top_p, allowed):
    # Shuffle token order so the sets are about values, not positions.
    order = torch.tensor([3, 0, 4, 1, 2])
    logits = torch.empty(5)
    logits[order] = FIVE_PROBS.log()
    counts = draw_counts(logits, 4000, device, top_p=top_p)
    kept = order[:allowed]
    assert int(counts.sum() - counts[kept].sum()) == 0
    assert bool((counts[kept] > 0).all())
    renormalised = FIVE_PROBS[:allowed] / FIVE_PROBS[:allowed].sum()
    assert chi_square(counts[kept], renormalised) < 30.0


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_draws_only_the_k_most_likely(device):
    logits = FIVE_PROBS.log().flip(0)  # most likely token last
    counts = draw_counts(logits, 3000, device, top_k=3)
    assert counts[:2].sum() == 0
    assert bool((counts[2:] > 0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_and_top_p_together_keep_the_smaller_set(device):
    logits = FIVE_PROBS.log()
    assert draw_counts(logits, 2000, device, top_k=2, top_p=0.85)[2:].sum() == 0  # top_k is tighter
    assert draw_counts(logits, 2000, device, top_k=4, top_p=0.75)[2:].sum() == 0  # top_p is tighter


@pytest.mark.parametrize("device", DEVICES)
def test_min_p_keeps_tokens_above_fraction_of_max_after_temperature(device):
    logits = FIVE_PROBS.log()
    # min_p 0.15: p >= 0.075 keeps {0, 1, 2}.
    counts = draw_counts(logits, 3000, device, min_p=0.15)
    assert counts[3:].sum() == 0 and bool((counts[:3] > 0).all())
    # Temperature 2 flattens to p ~ sqrt(p): ratios to the max are .77, .45, .35, .28 -> keeps {0..3}.
    counts = draw_counts(logits, 3000, device, temperature=2.0, min_p=0.3)
    assert counts[4] == 0 and bool((counts[:4] > 0).all())


def test_repetition_penalty_matches_hugging_face():
    from transformers import RepetitionPenaltyLogitsProcessor

    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 50, generator=generator) * 3
    logits[:, 0] = 0.0  # zero logits stay zero either way
    history = torch.randint(0, 50, (4, 30), generator=generator)  # prompt + output ids, with repeats
    history[:, 0] = 0
    penalties = [1.0, 1.3, 0.7, 2.0]
    presence = torch.zeros(4, 50, dtype=torch.bool).scatter_(1, history, True)

    ours = apply_repetition_penalty(logits, presence, torch.tensor(penalties))
    for row, penalty in enumerate(penalties):
        theirs = RepetitionPenaltyLogitsProcessor(penalty)(history[row : row + 1], logits[row : row + 1].clone())
        assert torch.equal(ours[row], theirs[0])
    assert torch.equal(ours[0], logits[0])

    tensors = make_tensors(4, "cpu", temperature=0.0, repetition_penalty=penalties)
    assert tensors.any_penalty
    assert torch.equal(sample(logits, tensors, presence).token_ids, ours.argmax(dim=-1))
    with pytest.raises(ValueError, match="presence"):
        sample(logits, tensors)


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_log_softmax_after_penalty_before_temperature(device):
    generator = torch.Generator().manual_seed(7)
    logits = (torch.randn(3, 100, generator=generator) * 2).to(device)
    presence = (torch.rand(3, 100, generator=generator) < 0.2).to(device)
    tensors = make_tensors(
        3, device, temperature=[0.0, 0.7, 1.5], top_p=0.9, repetition_penalty=[1.0, 1.2, 1.5], logprobs=[0, 5, 2]
    )
    assert tensors.max_logprobs == 5
    result = sample(logits, tensors, presence)

    expected = apply_repetition_penalty(logits, presence, tensors.repetition_penalty).log_softmax(dim=-1)
    expected_top, expected_ids = expected.topk(5, dim=-1)
    assert torch.allclose(result.logprobs, expected.gather(1, result.token_ids.unsqueeze(1)).squeeze(1))
    assert torch.equal(result.top_ids, expected_ids)
    assert torch.allclose(result.top_logprobs, expected_top)
    assert result.top_ids.shape == (3, 5) and result.top_logprobs.dtype == torch.float32
    assert result.token_ids[0] == result.top_ids[0, 0]  # the greedy row took the most likely token


def test_noise_is_splitmix64_of_seed_step_and_token():
    """The hash is exact integer arithmetic, so a pure-Python SplitMix64 reproduces it bit for bit."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    seed, step_index, vocab = 2**64 - 5, 9, 5
    state = mix(mix(seed) ^ step_index)
    words = [mix((state + (w + 1) * 0x9E3779B97F4A7C15) & mask) for w in range(3)]
    bits = [(word >> half) & 0xFFFFFF for word in words for half in (0, 32)][:vocab]
    expected = [math.log(-math.log((b + 0.5) * 2.0**-24)) for b in bits]

    noise = _log_exponential_noise(torch.tensor([seed - 2**64]), torch.tensor([step_index]), vocab)
    assert noise.shape == (1, vocab)
    assert torch.allclose(noise[0], torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_from_lists_wraps_seeds_and_sets_flags():
    tensors = make_tensors(
        3,
        "cpu",
        temperature=[0.0, 0.8, 1.0],
        top_p=[0.5, 1.0, 1.0],  # only the greedy row asks for top_p: the stage is skipped
        top_k=[0, 0, 20],
        min_p=[0.0, 0.1, 0.0],
        seed=[2**64 - 1, 2**63, 5],
        step_index=[0, 1, 2],
        logprobs=[0, 3, 1],
    )
    assert tensors.seed.tolist() == [-1, -(2**63), 5]
    assert tensors.step_index.dtype == torch.int64 and tensors.temperature.dtype == torch.float32
    assert (tensors.all_greedy, tensors.any_top_k, tensors.any_top_p, tensors.any_min_p) == (False, True, False, True)
    assert (tensors.any_penalty, tensors.max_logprobs) == (False, 3)


def test_empty_batch():
    result = sample(torch.empty(0, 10), make_tensors(0, "cpu", logprobs=0))
    assert result.token_ids.shape == (0,)


def valid_params(**overrides) -> common_pb2.SamplingParams:
    fields = dict(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1, seed=3, logprobs=5)
    fields.update(overrides)
    return common_pb2.SamplingParams(**fields)


def test_validate_sampling_params_accepts_valid_values():
    validate_sampling_params(valid_params(), vocab_size=49152)
    validate_sampling_params(valid_params(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, logprobs=MAX_LOGPROBS))
    validate_sampling_params(valid_params(top_k=49152, min_p=1.0, seed=2**64 - 1), vocab_size=49152)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"temperature": -0.5}, "sampling.temperature must be a finite number >= 0 (0 = greedy), got -0.5"),
        ({"temperature": math.nan}, "sampling.temperature must be a finite number >= 0 (0 = greedy), got nan"),
        ({"temperature": math.inf}, "sampling.temperature must be a finite number >= 0 (0 = greedy), got inf"),
        ({"top_p": 1.5}, "sampling.top_p must be in (0, 1] (1 = off), got 1.5"),
        ({"top_p": 0.0}, "sampling.top_p must be in (0, 1] (1 = off), got 0"),
        ({"top_p": math.nan}, "sampling.top_p must be in (0, 1] (1 = off), got nan"),
        ({"top_k": 50000}, "sampling.top_k must be in [0, 49152] (0 = off), got 50000"),
        ({"min_p": -0.25}, "sampling.min_p must be in [0, 1] (0 = off), got -0.25"),
        ({"min_p": 1.5}, "sampling.min_p must be in [0, 1] (0 = off), got 1.5"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty must be a finite number > 0 (1 = off), got 0"),
        ({"repetition_penalty": -1.0}, "sampling.repetition_penalty must be a finite number > 0 (1 = off), got -1"),
        ({"repetition_penalty": math.inf}, "sampling.repetition_penalty must be a finite number > 0 (1 = off), got inf"),
        ({"logprobs": 21}, "sampling.logprobs must be in [0, 20], got 21"),
    ],
)
def test_validate_sampling_params_names_the_bad_field(overrides, message):
    with pytest.raises(ValueError) as raised:
        validate_sampling_params(valid_params(**overrides), vocab_size=49152)
    assert str(raised.value) == message


@pytest.mark.parametrize("device", DEVICES)
def test_presence_and_frequency_penalties_subtract_from_counted_tokens(device):
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.0], [3.0, 2.9, 1.0, 0.0]], device=device)
    counts = torch.tensor([[2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]], device=device)
    tensors = make_tensors(2, device, temperature=0.0, logprobs=4)
    tensors.presence_penalty = torch.tensor([0.5, 0.5], device=device)
    tensors.frequency_penalty = torch.tensor([0.25, 0.25], device=device)
    tensors.output_counts = counts
    result = sample(logits, tensors)
    assert result.token_ids.tolist() == [1, 0]  # row 0: 3 - 0.5 - 0.5 = 2.0 < 2.9; row 1 has no counts
    expected = torch.tensor([2.0, 2.9, 0.25, 0.0]).log_softmax(-1)  # logprobs follow the penalties
    assert result.top_logprobs[0].tolist() == pytest.approx(sorted(expected.tolist(), reverse=True), abs=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_is_added_before_greedy_and_random_sampling(device):
    logits = torch.tensor([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0]], device=device)
    tensors = make_tensors(2, device, temperature=[0.0, 1.0], seed=[1, 2])
    tensors.logit_bias = torch.tensor([[-100.0, 0.0, 1.0], [-100.0, 100.0, 0.0]], device=device)
    assert sample(logits, tensors).token_ids.tolist() == [2, 1]


def test_logit_bias_and_additive_penalties_are_checked():
    with pytest.raises(ValueError, match=r"sampling.logit_bias\[3\]: 101 is outside \[-100, 100\]"):
        validate_sampling_params(common_pb2.SamplingParams(top_p=1.0, repetition_penalty=1.0, logit_bias={3: 101.0}), 10)
    with pytest.raises(ValueError, match=r"token id 12 is outside the vocabulary \[0, 10\)"):
        validate_sampling_params(common_pb2.SamplingParams(top_p=1.0, repetition_penalty=1.0, logit_bias={12: 1.0}), 10)
    with pytest.raises(ValueError, match=r"sampling.frequency_penalty must be in \[-2, 2\]"):
        validate_sampling_params(common_pb2.SamplingParams(top_p=1.0, repetition_penalty=1.0, frequency_penalty=2.5), 10)


def test_a_token_at_minus_infinity_is_never_drawn():
    """A masked token (-inf, as structured output leaves it) loses to any finite one whatever its
    noise: seed 7 at step 56 draws the all-ones 24-bit uniform for token 32303, once rounded to 1.0."""
    steps = list(range(40, 72))
    tensors = tensors_from_lists(temperature=[1.0] * len(steps), top_p=[1.0] * len(steps), top_k=[0] * len(steps), min_p=[0.0] * len(steps),
                                 repetition_penalty=[1.0] * len(steps), seed=[7] * len(steps), step_index=steps, logprobs=[0] * len(steps),
                                 device="cpu")
    logits = torch.full((len(steps), 49152), -math.inf)
    logits[:, 84] = -5.0
    assert sample(logits, tensors).token_ids.tolist() == [84] * len(steps)
