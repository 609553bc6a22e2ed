"""`SamplingTensors` of hand-picked per-row parameters, for tests that drive `sample` directly.

They are made the way a step's are: the rows start as sequences of a real `SequenceTable`, which
admits one step of them and gathers the tensors and host flags (greedy rows, seed wrap) itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stageserve.device.sampler import SamplingTensors
from stageserve.device.sequence_table import SequenceTable
from stageserve.device.step_plan import StartedSequence, Step
from stageserve.v1 import common_pb2, device_pb2


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
    """The `SamplingTensors` of S rows from per-row lists (all of length S); seeds are uint64 values."""
    rows = list(range(len(temperature)))
    device = torch.device(device)
    table = SequenceTable(max(1, len(rows)), vocab_size=1, block_size=1, device=device)
    params = zip(temperature, top_p, top_k, min_p, repetition_penalty, seed, logprobs, strict=True)
    started = [
        StartedSequence(row, 1, common_pb2.SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m, repetition_penalty=r, seed=s, logprobs=n), [])
        for row, (t, p, k, m, r, s, n) in zip(rows, params)
    ]
    step = Step(
        plan=device_pb2.StepPlan(step_id=1), step_id=1, seq_index=rows, generation=[1] * len(rows), start_pos=[0] * len(rows),
        num_tokens=[1] * len(rows), token_ids=[0] * len(rows), sample=[True] * len(rows), num_new_blocks=[1] * len(rows),
        new_block_ids=rows, started=started, finished=[], sampled_seq_index=rows, sampled_generation=[1] * len(rows),
        has_placeholder=False,
    )
    admitted = table.admit(step)
    if started:
        table.apply_starts(table.stage_starts(started))
    return table.sampling_tensors(admitted, torch.tensor(rows, dtype=torch.int64, device=device),
                                  torch.tensor(list(step_index), dtype=torch.int64, device=device))
