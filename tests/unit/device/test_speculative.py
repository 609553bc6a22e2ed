"""Speculative decoding on the device: the n-gram proposer, the acceptance rule and its exactness.

The exactness test samples the target with the real sampler (its counter-based noise, one seed
per row) and applies `accept_drafts`: the emitted tokens must follow the target distribution, and
a point-mass draft ``d`` must be accepted with probability ``p(d)`` (Leviathan et al. 2023).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from stageserve.device.speculation.proposer import NgramProposer, TokenHistory
from stageserve.device.sampler import sample
from stageserve.device.sequence_table import SequenceTable
from stageserve.device.speculation.verification import accept_drafts
from stageserve.device.step_plan import PlanError, decode_plan
from stageserve.v1 import common_pb2

from .sampling_tensors import tensors_from_lists
from .test_sequence_table import LIMITS, VOCAB, check_sampling, decode, prefill

CPU = torch.device("cpu")


def history_of(*sequences: list[int], width: int = 32) -> TokenHistory:
    history = TokenHistory(len(sequences), width, CPU)
    for row, tokens in enumerate(sequences):
        history.tokens[row, : len(tokens)] = torch.tensor(tokens)
        history.length[row] = len(tokens)
    return history


def propose(proposer: NgramProposer, history: TokenHistory, num_drafts: int) -> list[list[int]]:
    """Valid drafts per row, as lists."""
    rows = torch.arange(history.length.shape[0])
    drafts, valid = proposer.propose(history, rows, num_drafts, int(history.length.max()))
    return [d[v].tolist() for d, v in zip(drafts, valid)]


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence():
    """The suffix [5, 6, 7] occurred at the start: propose what followed it, as far as known."""
    history = history_of([5, 6, 7, 8, 9, 5, 6, 7])
    assert propose(NgramProposer(1, 3), history, 3) == [[8, 9, 5]]
    assert propose(NgramProposer(1, 3), history, 6) == [[8, 9, 5, 6, 7]]  # the known tokens only


def test_ngram_prefers_the_longest_match_then_the_latest():
    """n = 2 ([1, 2]) matches once, early; n = 1 ([2]) matches later: the longer wins. Among equal
    lengths the most recent occurrence wins."""
    assert propose(NgramProposer(1, 2), history_of([1, 2, 3, 4, 2, 9, 1, 2]), 2) == [[3, 4]]
    assert propose(NgramProposer(1, 1), history_of([4, 1, 4, 2, 4]), 1) == [[2]]


def test_ngram_without_a_match_proposes_nothing():
    history = history_of([1, 2, 3, 4], [7, 7, 7, 7])
    assert propose(NgramProposer(2, 3), history, 3) == [[], [7]]  # [7, 7, 7] at 0 is followed by one known token


def test_ngram_rejects_bad_sizes():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramProposer(3, 2)


def test_accept_drafts_stops_at_the_first_mismatch_or_invalid_draft():
    target = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [0, 6, 7], [1, 2, 3]])
    valid = torch.tensor([[True] * 3, [True] * 3, [True] * 3, [True, False, False]])
    assert accept_drafts(target, drafts, valid).tolist() == [3, 1, 0, 1]
    empty = torch.zeros(2, 0, dtype=torch.int64)
    assert accept_drafts(target[:2, :1], empty, empty.bool()).tolist() == [0, 0]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# Chi-square critical values at p = 0.001 by degrees of freedom (a fixed seed: the test is deterministic).
CHI2_999 = {4: 18.47, 5: 20.52}


def test_verification_follows_the_target_distribution_and_accepts_with_p_of_the_draft():
    """Rows = independent trials (one seed each) of one speculative row: target p at the pending
    position, q = a point mass on draft d. P(accept) = p(d); the first emitted token ~ p; the token
    emitted on rejection ~ p without d, renormalised (max(0, p - q) normalised)."""
    trials, temperature = 20000, 0.7
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, 1.5])  # [V]
    p = torch.softmax(logits / temperature, dim=0)
    draft = 1
    tensors = tensors_from_lists(
        temperature=[temperature] * trials, top_p=[1.0] * trials, top_k=[0] * trials, min_p=[0.0] * trials,
        repetition_penalty=[1.0] * trials, seed=list(range(trials)), step_index=[3] * trials, logprobs=[0] * trials, device=CPU,
    )
    target = sample(logits.expand(trials, -1).contiguous(), tensors).token_ids  # [trials]
    accepted = accept_drafts(target.unsqueeze(1), torch.full((trials, 1), draft), torch.ones(trials, 1, dtype=torch.bool))
    emitted = target  # accepted: the draft itself (== target); rejected: the target's token
    rate = accepted.float().mean().item()
    assert abs(rate - p[draft].item()) < 4 * math.sqrt(p[draft] * (1 - p[draft]) / trials)
    counts = torch.bincount(emitted, minlength=6).float()
    assert chi_square(counts, p) < CHI2_999[5]
    residual = p.clone()
    residual[draft] = 0
    residual /= residual.sum()
    rejected = torch.bincount(emitted[accepted == 0], minlength=6).float()
    assert rejected[draft] == 0
    keep = torch.arange(6) != draft
    assert chi_square(rejected[keep], residual[keep]) < CHI2_999[4]


def test_history_records_prompts_of_started_sequences():
    from stageserve.device.step_plan import StartedSequence

    history = TokenHistory(3, 8, CPU)
    history.apply_starts(history.stage_starts([StartedSequence(2, 1, common_pb2.SamplingParams(), [4, 5, 6])]))
    assert history.tokens[2, :3].tolist() == [4, 5, 6]
    assert history.length.tolist() == [0, 0, 3] and history.prompt_len.tolist() == [0, 0, 3]


SPECULATING = dataclasses.replace(LIMITS, num_speculative_tokens=3)


@pytest.mark.parametrize(
    ("plan", "limits", "message"),
    [
        (decode(2, 0, num_tokens=[3], token_ids=[-1] * 3, num_draft_tokens=[2]), LIMITS, "this device does not speculate"),
        (decode(2, 0, num_tokens=[5], token_ids=[-1] * 5, num_draft_tokens=[4]), SPECULATING, "exceeds the device's num_speculative_tokens=3"),
        (decode(2, 0, num_tokens=[3], token_ids=[-1, 5, 6], num_draft_tokens=[2]), SPECULATING, "must carry 1 \\+ 2 placeholders"),
        (decode(2, 0, num_tokens=[3], token_ids=[-1] * 3, num_draft_tokens=[2, 0]), SPECULATING, "num_draft_tokens has 2 entries"),
    ],
)
def test_plans_with_drafts_are_checked(plan, limits, message):
    with pytest.raises(PlanError, match=message):
        decode_plan(plan, limits, check_sampling)


def test_a_penalised_sequence_may_not_draft():
    table = SequenceTable(SPECULATING.max_num_seqs, VOCAB, SPECULATING.block_size, CPU)
    penalised = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.2)
    table.admit(decode_plan(prefill(1, 0, sampling=penalised, blocks=(0, 1)), SPECULATING, check_sampling))
    with pytest.raises(PlanError, match="num_draft_tokens must be 0"):
        table.admit(decode_plan(decode(2, 0, num_tokens=[3], token_ids=[-1] * 3, num_draft_tokens=[2]), SPECULATING, check_sampling))
    step = table.admit(decode_plan(decode(3, 0, num_draft_tokens=[0]), SPECULATING, check_sampling))
    assert step.step.speculative and step.step.sampled_num_drafts == [0]


def test_a_batch_without_some_decode_entries_computes_the_same_logits_for_the_rest(tmp_path):
    """`ForwardBatch.keep_decode` (a CPU step dropping the entries of drafts that were not proposed):
    the entries and rows it keeps get the logits the whole batch gives them, in order."""
    from stageserve.device.model.forward_batch import build_forward_batch
    from stageserve.device.model.kv_cache import PagedKVCache
    from stageserve.device.model.decoder import DecoderModel
    from tests.tiny_checkpoint import write_tiny_checkpoint

    model = DecoderModel.from_path(write_tiny_checkpoint(tmp_path / "tiny"), torch.float32, CPU)
    block_size, tables = 4, ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11])
    prompts = ([5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16])

    def logits_of(keep: list[bool] | None) -> tuple[torch.Tensor, list[int]]:
        kv = PagedKVCache(model.config, 12, block_size, torch.float32, CPU)
        model.forward(build_forward_batch([(p, 0, t, False) for p, t in zip(prompts, tables)], block_size, CPU), kv)
        # A decode row's pending token and three drafts, a one-token chunk, a longer chunk that samples.
        rows = [([1 + j], 5 + j, tables[0], True) for j in range(4)] + [([17], 3, tables[1], True), ([18, 19], 4, tables[2], True)]
        batch = build_forward_batch(rows, block_size, CPU)
        kept = list(range(6))
        if keep is not None:
            batch, kept_tensor = batch.keep_decode(torch.tensor(keep))
            kept = kept_tensor.tolist()
        return model.forward(batch, kv), kept

    full, _ = logits_of(None)
    part, kept = logits_of([True, True, False, False, True])  # the decode row's last two drafts were not proposed
    assert kept == [0, 1, 4, 5]
    torch.testing.assert_close(part, full[kept], rtol=1e-5, atol=1e-5)


def test_the_host_prompt_lookup_drafts_what_the_device_proposer_drafts():
    """`stageserve.prompt_lookup.PromptLookup` (prepare's replay, one token at a time) and the
    device's vectorised `NgramProposer` follow one rule: the same drafts after every prefix of
    repetitive random sequences."""
    from stageserve.prompt_lookup import MAX_N, MIN_N, PromptLookup

    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        tokens = torch.randint(0, 6, (40,), generator=generator).tolist()  # 6 token ids: many matches of every length
        lookup = PromptLookup(tokens[:1])
        for length in range(2, len(tokens) + 1):
            lookup.extend(tokens[length - 1 : length])
            assert lookup.propose(4) == propose(NgramProposer(MIN_N, MAX_N), history_of(tokens[:length], width=48), 4)[0], tokens[:length]


def test_a_cpu_step_drops_the_entries_of_drafts_not_proposed_and_measuring_proposes_them_all():
    """`Speculation.without_unproposed`: of a decode row asking for 3 drafts of which the proposer
    made 1, the pending token's and that draft's entries run (the entries of drafts 2 and 3 are
    dropped), next to a row that drafted nothing and a prefill row; every entry runs when all are
    proposed, and under `Speculation.proposing_every_draft` the proposer's misses count as proposed."""
    from stageserve.device.model.forward_batch import build_forward_batch
    from stageserve.device.speculation.verification import Speculation
    from stageserve.v1 import device_pb2

    table = SequenceTable(SPECULATING.max_num_seqs, VOCAB, SPECULATING.block_size, CPU)
    for step_id, seq, blocks in ((1, 0, (0, 1)), (2, 1, (2, 3))):
        table.admit(decode_plan(prefill(step_id, seq, blocks=blocks, num_draft_tokens=[0]), SPECULATING, check_sampling))
    plan = device_pb2.StepPlan(step_id=3, started=prefill(0, 2).started, seq_index=[0, 1, 2], generation=[1, 1, 1], start_pos=[3, 3, 0],
                               num_tokens=[4, 2, 3], token_ids=[-1] * 6 + [5, 6, 7], sample=[True] * 3, num_new_blocks=[0, 0, 1],
                               new_block_ids=[4], num_draft_tokens=[3, 1, 0])
    admitted = table.admit(decode_plan(plan, SPECULATING, check_sampling))
    speculation = Speculation(NgramProposer(), 3, SPECULATING.max_num_seqs, SPECULATING.max_model_len, SPECULATING.block_size, CPU)
    assert speculation.drops_unproposed  # a CPU device
    rows, staged = speculation.stage_rows(admitted)
    batch = build_forward_batch(rows, SPECULATING.block_size, CPU)  # entries 0-3 (row 0), 4-5 (row 1), then the prompt
    valid = torch.tensor([[True, False, False], [False, False, False]])
    kept_batch, kept = speculation.without_unproposed(staged, batch, valid)
    assert kept.tolist() == [0, 1, 4, 6]  # row 0: pending + draft 1; row 1: pending; the prefill row's sample
    assert kept_batch.num_decode == 3 and kept_batch.input_ids.shape[0] == 3 + 3
    assert speculation.without_unproposed(staged, batch, torch.tensor([[True] * 3, [True, False, False]])) == (batch, None)

    history = history_of([1, 2, 3], [4, 5, 6], [7, 8, 9])  # no repeats: prompt lookup proposes nothing
    with speculation.proposing_every_draft():
        _, measured = speculation.proposer.propose(history, torch.tensor([0, 1]), 3, 3)
    _, served = speculation.proposer.propose(history, torch.tensor([0, 1]), 3, 3)
    assert measured.all() and not served.any()
