"""The draft-model proposer on the tiny checkpoint, used as its own draft model: its drafts are the
model's greedy continuation, also after a step that accepted every draft (whose last draft the
draft model never ran) and after a step without drafts; it never writes a prompt position again.

The target's verification is not run here: the test plays it, advancing the token history as a
step that accepted every draft would (tests/integration/test_speculative.py runs the whole path).
"""

from __future__ import annotations

import pytest
import torch

from stageserve.device.speculation.draft_model import DraftModelProposer
from stageserve.device.model.forward_batch import build_forward_batch
from stageserve.device.model.decoder import DecoderModel
from stageserve.device.speculation.proposer import ProposalStep, StepLayout, TokenHistory
from stageserve.device.speculation.verification import PLACEHOLDER
from tests.unit.device.greedy_reference import BLOCK_SIZE, CPU, NUM_BLOCKS, TABLE, greedy_continuation
from tests.tiny_checkpoint import write_tiny_checkpoint

K = 3
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]  # two full blocks: the second could be a shared prefix block


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> DecoderModel:
    return DecoderModel.from_path(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny")), torch.float32, CPU)


def test_drafts_are_the_greedy_continuation_and_prompt_positions_are_not_written_again(model):
    expected = greedy_continuation(model, PROMPT, 3 * K + 4)  # the tokens the four steps below emit
    proposer = DraftModelProposer(model, model.config.vocab_size, NUM_BLOCKS, BLOCK_SIZE, torch.float32)
    history = TokenHistory(1, 32, CPU)
    seq = torch.tensor([0])

    prefill = build_forward_batch([(PROMPT, 0, TABLE, True)], BLOCK_SIZE, CPU)
    drafts, valid = proposer.propose(history, seq[:0], 0, 0, ProposalStep(prefill, proposer.stage(StepLayout([], [], []))))
    assert drafts.shape == valid.shape == (0, 0)
    prompt_kv = proposer.kv_cache.kv[:, :, :2].clone()  # the prompt's two blocks
    history.prompt_len[0] = len(PROMPT)

    emitted = 1  # the prefill's token, pending

    def decode_step(num_drafts: int) -> tuple[list[int], list[int]]:
        """One decode row asking for ``num_drafts``, at its true position: (its drafts, the greedy
        tokens after its pending one); the history then advances as if every draft was accepted."""
        nonlocal emitted
        length = len(PROMPT) + emitted
        history.tokens[0, :length] = torch.tensor(PROMPT + expected[:emitted])
        history.length[0] = length
        rows = [([PLACEHOLDER], length - 1 + j, TABLE, True) for j in range(1 + num_drafts)]
        batch = build_forward_batch(rows, BLOCK_SIZE, CPU)
        staged = proposer.stage(StepLayout([0], [num_drafts], []))
        drafts, valid = proposer.propose(history, seq, num_drafts, length, ProposalStep(batch, staged))
        assert valid.all()
        greedy = expected[emitted : emitted + num_drafts]
        emitted += 1 + num_drafts
        return drafts[0].tolist(), greedy

    drafts, greedy = decode_step(K)
    assert drafts == greedy == expected[1 : 1 + K]
    assert torch.equal(proposer.kv_cache.kv[:, :, :2], prompt_kv)  # the first decode step's pos - 1 went to the scratch block
    drafts, greedy = decode_step(K)  # every draft was accepted: the last one goes through the draft model at pos - 1
    assert drafts == greedy
    assert decode_step(0) == ([], [])
    drafts, greedy = decode_step(K)  # the row without drafts kept the draft's KV up to date
    assert drafts == greedy and len(drafts) == K
