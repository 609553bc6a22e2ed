"""`SamplingTensors` built from per-row Python lists, for tests that drive `sample` without a sequence table."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stageserve.device.sampler import SamplingTensors
from stageserve.sampling_rules import is_greedy, seed_as_int64


def tensors_from_lists(
    *,
    temperature: Sequence[float],
    top_p: Sequence[float],
    top_k: Sequence[int],
    min_p: Sequence[float],
    repetition_penalty: Sequence[float],
    seed: Sequence[int],
    step_index: Sequence[int],
    logprobs: Sequence[int],
    device: torch.device | str,
) -> SamplingTensors:
    """The tensors and host flags of S rows from per-row lists (all of length S), as the sequence table
    computes them: uint64 seeds stored as int64 with the same bits, greedy rows (``top_k == 1``
    included) with temperature 0."""
    greedy = [is_greedy(temp, k) for temp, k in zip(temperature, top_k, strict=True)]
    floats = torch.tensor(
        [[0.0 if g else temp for g, temp in zip(greedy, temperature)], list(top_p), list(min_p), list(repetition_penalty)],
        dtype=torch.float32,
    ).to(device)
    ints = torch.tensor([list(top_k), [seed_as_int64(s) for s in seed], list(step_index)], dtype=torch.int64).to(device)
    sampled_rows = [i for i, g in enumerate(greedy) if not g]
    return SamplingTensors(
        temperature=floats[0],
        top_p=floats[1],
        min_p=floats[2],
        repetition_penalty=floats[3],
        top_k=ints[0],
        seed=ints[1],
        step_index=ints[2],
        all_greedy=not sampled_rows,
        any_top_k=any(top_k[i] > 0 for i in sampled_rows),
        any_top_p=any(top_p[i] < 1.0 for i in sampled_rows),
        any_min_p=any(min_p[i] > 0.0 for i in sampled_rows),
        any_penalty=any(p != 1.0 for p in repetition_penalty),
        max_logprobs=max(logprobs, default=0),
    )
