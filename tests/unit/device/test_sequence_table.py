"""Plan decoding (`step_plan`) and the sequence table's checks, commits and device state, on hand-built plans."""

from __future__ import annotations

import pytest
import torch

from stageserve.device.sampler import validate_sampling_params
from stageserve.device.sequence_table import SequenceTable
from stageserve.device.step_plan import PlanError, PlanLimits, decode_plan
from stageserve.v1 import common_pb2, device_pb2

VOCAB = 100
LIMITS = PlanLimits(max_num_seqs=4, vocab_size=VOCAB, num_blocks=10, block_size=4, max_step_tokens=16, max_model_len=32)
GREEDY = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0)


def check_sampling(params: common_pb2.SamplingParams) -> None:
    validate_sampling_params(params, VOCAB)


def start(seq: int, generation: int = 1, sampling=GREEDY, prompt=(5, 6, 7)) -> common_pb2.SequenceStart:
    return common_pb2.SequenceStart(seq_index=seq, generation=generation, request_id=f"r{seq}", sampling=sampling, prompt_token_ids=prompt)


def prefill(step_id: int, seq: int, generation: int = 1, blocks=(0,), sampling=GREEDY, **fields) -> device_pb2.StepPlan:
    plan = dict(step_id=step_id, started=[start(seq, generation, sampling)], seq_index=[seq], generation=[generation],
                start_pos=[0], num_tokens=[3], token_ids=[5, 6, 7], sample=[True], num_new_blocks=[len(blocks)],
                new_block_ids=list(blocks))
    plan.update(fields)
    return device_pb2.StepPlan(**plan)


def decode(step_id: int, seq: int, generation: int = 1, start_pos: int = 3, token: int = -1, **fields) -> device_pb2.StepPlan:
    plan = dict(step_id=step_id, seq_index=[seq], generation=[generation], start_pos=[start_pos], num_tokens=[1],
                token_ids=[token], sample=[True], num_new_blocks=[0])
    plan.update(fields)
    return device_pb2.StepPlan(**plan)


@pytest.fixture
def table() -> SequenceTable:
    return SequenceTable(LIMITS.max_num_seqs, VOCAB, LIMITS.block_size, torch.device("cpu"))


def admit(table: SequenceTable, plan: device_pb2.StepPlan):
    return table.admit(decode_plan(plan, LIMITS, check_sampling))


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (prefill(1, 0, generation=1, num_tokens=[2]), "token_ids has 3 entries, sum(num_tokens) is 2"),
        (prefill(1, 0, start_pos=[0, 0]), "start_pos has 2 entries"),
        (prefill(1, 0, blocks=(10,)), "new_block_ids 10 is out of range; must be < 10"),
        (prefill(1, 4), "seq_index 4 is out of range"),
        (prefill(1, 0, token_ids=[5, 6, VOCAB]), f"token_ids must be in [0, {VOCAB})"),
        (prefill(1, 0, num_tokens=[17], token_ids=[1] * 17), "17 tokens exceed max_step_tokens=16"),
        (prefill(1, 0, start_pos=[30]), "exceeds max_model_len=32"),
        (prefill(1, 0, sampling=common_pb2.SamplingParams(temperature=1.0, top_p=0.0, repetition_penalty=1.0)), "sampling.top_p"),
        (prefill(1, 0, sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.0, repetition_penalty=0.0)), "sampling.repetition_penalty"),
        (device_pb2.StepPlan(step_id=1, seq_index=[1, 1], generation=[1, 1], start_pos=[0, 0], num_tokens=[1, 1],
                             token_ids=[1, 1], sample=[True, True], num_new_blocks=[0, 0]), "more than one row"),
    ],
)
def test_decode_plan_refuses_malformed_plans_naming_the_field(plan, message):
    with pytest.raises(PlanError) as refused:
        decode_plan(plan, LIMITS, check_sampling)
    assert message in str(refused.value)


def test_admit_refuses_rows_that_do_not_match_the_table_and_changes_nothing(table):
    with pytest.raises(PlanError, match="not started"):
        admit(table, decode(1, seq=0))
    with pytest.raises(PlanError, match="no token has been sampled"):
        admit(table, _prefill_then_placeholder_same_step())
    admit(table, prefill(2, 0, generation=3, blocks=(2,)))
    with pytest.raises(PlanError, match="generation 2 is stale; the sequence's generation is 3"):
        admit(table, decode(3, seq=0, generation=2))
    with pytest.raises(PlanError, match="cannot hold start_pos \\+ num_tokens = 5 tokens"):
        admit(table, decode(3, seq=0, generation=3, start_pos=4))  # one block of 4 tokens
    with pytest.raises(PlanError, match="only allowed in single-token"):
        admit(table, device_pb2.StepPlan(step_id=3, seq_index=[0], generation=[3], start_pos=[3], num_tokens=[2],
                                         token_ids=[-1, 4], sample=[True], num_new_blocks=[1], new_block_ids=[4]))
    # The refusals left the sequence as the prefill made it: a decode with one new block is accepted.
    step = admit(table, decode(3, seq=0, generation=3, start_pos=4, num_new_blocks=[1], new_block_ids=[7]))
    assert step.block_tables == [[2, 7]]
    assert step.sampled_step_index == [1]


def _prefill_then_placeholder_same_step() -> device_pb2.StepPlan:
    """A new sequence whose first row is already a placeholder: nothing was sampled for it yet."""
    return device_pb2.StepPlan(step_id=1, started=[start(1)], seq_index=[1], generation=[1], start_pos=[0], num_tokens=[1],
                               token_ids=[-1], sample=[True], num_new_blocks=[1], new_block_ids=[0])


def test_finished_sequences_are_dropped_and_reset_forgets_all(table):
    admit(table, prefill(1, 0, blocks=(1,)))
    admit(table, prefill(2, 1, blocks=(2,)))
    step = admit(table, decode(3, seq=0, finished=[0]))
    assert step.block_tables == [[1]]  # the finishing row still sees its blocks
    with pytest.raises(PlanError, match="not started"):
        admit(table, decode(4, seq=0, start_pos=4))
    assert table.active_count() == 1
    table.reset()
    assert table.active_count() == 0


def test_device_state_gathers_sampling_tensors_and_tracks_presence(table):
    seeded = common_pb2.SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.0, repetition_penalty=1.2,
                                       seed=(1 << 64) - 1, logprobs=3)
    step = table.admit(decode_plan(prefill(1, 2, sampling=seeded), LIMITS, check_sampling))
    table.apply_starts(table.stage_starts(step.step.started))
    rows = torch.tensor([2])
    tensors = table.sampling_tensors(step, rows, torch.tensor(step.sampled_step_index))
    assert tensors.temperature.tolist() == pytest.approx([0.7]) and tensors.top_p.tolist() == pytest.approx([0.9])
    assert tensors.top_k.tolist() == [5] and tensors.seed.tolist() == [-1]  # uint64 max as int64 bits
    assert tensors.repetition_penalty.tolist() == pytest.approx([1.2]) and tensors.step_index.tolist() == [0]
    assert (tensors.all_greedy, tensors.any_top_k, tensors.any_top_p, tensors.any_min_p, tensors.any_penalty) == (False, True, True, False, True)
    assert tensors.max_logprobs == 3
    assert torch.nonzero(table.presence[2]).view(-1).tolist() == [5, 6, 7]  # the prompt
    table.record_sampled(rows, torch.tensor([42]), tensors)
    assert table.last_token[2].item() == 42
    assert torch.nonzero(table.presence[2]).view(-1).tolist() == [5, 6, 7, 42]



def test_a_start_rewrites_only_the_vocabulary_rows_its_parameters_use(table):
    """The [N, V] tables hold memory only where written: a plain start leaves its presence and count
    rows alone (read harmlessly: penalty 1 and 0 change no logit), a penalised one zeroes them
    first, and a bias row is zeroed for the next sequence of the row that had one."""
    def start_in(step_id: int, seq: int, generation: int, sampling):
        step = admit(table, prefill(step_id, seq, generation, blocks=(seq,), sampling=sampling))
        staged = table.stage_starts(step.step.started)
        table.apply_starts(staged)
        return step, staged

    penalised = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={9: 4.0})
    step, staged = start_in(1, 0, 1, penalised)
    rows = torch.tensor([0])
    table.record_sampled(rows, torch.tensor([42]), table.sampling_tensors(step, rows, torch.tensor(step.sampled_step_index)))
    assert [staged.clear_presence.tolist(), staged.clear_counts.tolist(), staged.clear_bias.tolist()] == [[0], [0], [0]]
    assert table.logit_bias[0, 9].item() == 4.0 and table.output_counts[0, 42].item() == 1.0
    assert torch.nonzero(table.presence[0]).view(-1).tolist() == [5, 6, 7, 42]
    admit(table, decode(2, seq=0, finished=[0]))

    _, staged = start_in(3, 0, 2, GREEDY)  # the row's next sequence sets none of them
    assert (staged.clear_presence, staged.clear_counts) == (None, None) and staged.clear_bias.tolist() == [0]
    assert not table.logit_bias[0].any()
    assert torch.nonzero(table.presence[0]).view(-1).tolist() == [5, 6, 7, 42] and table.output_counts[0, 42].item() == 1.0
    admit(table, decode(4, seq=0, generation=2, finished=[0]))

    _, staged = start_in(5, 0, 3, GREEDY)  # nothing left to clear
    assert (staged.clear_presence, staged.clear_counts, staged.clear_bias) == (None, None, None)
    admit(table, decode(6, seq=0, generation=3, finished=[0]))

    _, staged = start_in(7, 0, 4, common_pb2.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.1, frequency_penalty=0.2))
    assert torch.nonzero(table.presence[0]).view(-1).tolist() == [5, 6, 7] and not table.output_counts[0].any()

# ---- ownership: a row writes only KV blocks no other live sequence holds ----------------------------

def test_a_row_writing_a_block_another_live_sequence_holds_is_refused_and_changes_nothing(table):
    admit(table, prefill(1, 0, blocks=(0,)))
    with pytest.raises(PlanError, match="writes KV block 0, which another live sequence holds"):
        admit(table, prefill(2, 1, blocks=(0,)))  # seq 1's prompt would overwrite seq 0's block
    admit(table, prefill(3, 1, blocks=(1,)))  # refused plans changed nothing: seq 1 starts afresh
    admit(table, decode(4, 0))  # seq 0 still owns block 0


def test_a_decode_row_may_not_write_a_block_it_appended_from_another_sequence(table):
    admit(table, prefill(1, 0, blocks=(0,)))
    admit(table, prefill(2, 1, blocks=(1,)))
    # seq 1 reaches position 4 (its second block) and appends seq 0's block 0 to write into
    with pytest.raises(PlanError, match="row 0 \\(seq_index 1\\): writes KV block 0"):
        admit(table, decode(3, 1, start_pos=4, num_new_blocks=[1], new_block_ids=[0]))


def test_shared_prefix_blocks_are_read_by_several_sequences_but_written_by_none(table):
    full = dict(num_tokens=[4], token_ids=[5, 6, 7, 8], sample=[False])
    admit(table, prefill(1, 0, blocks=(0,), **full))  # seq 0 writes block 0 whole
    # seq 1 starts with block 0 as its cached prefix (read only) and writes its own block 1
    shared = admit(table, prefill(2, 1, blocks=(0, 1), start_pos=[4], num_tokens=[1], token_ids=[9]))
    assert shared.block_tables == [[0, 1]]
    assert admit(table, decode(3, 1, start_pos=5)).block_tables == [[0, 1]]
    # writing into the shared block is refused, for either holder
    with pytest.raises(PlanError, match="row 0 \\(seq_index 1\\): writes KV block 0"):
        admit(table, decode(4, 1, start_pos=3))
    with pytest.raises(PlanError, match="row 0 \\(seq_index 0\\): writes KV block 0"):
        admit(table, decode(4, 0, start_pos=3, token=12))


def test_a_block_freed_by_a_sequence_finished_in_the_same_plan_may_be_handed_on(table):
    admit(table, prefill(1, 0, blocks=(0,)))
    admit(table, prefill(2, 1, blocks=(0,), finished=[0]))  # prepare freed seq 0 and gives its block to seq 1
    with pytest.raises(PlanError, match="writes KV block 0"):
        admit(table, prefill(3, 2, blocks=(0,)))  # now seq 1 holds it


def test_a_block_a_sliding_window_released_may_be_handed_on_in_the_same_plan(table):
    full = dict(num_tokens=[4], token_ids=[5, 6, 7, 8], sample=[False])
    admit(table, prefill(1, 0, blocks=(0,), **full))
    admit(table, prefill(2, 0, blocks=(1,), start_pos=[4], started=[], **{**full, "sample": [True]}))  # seq 0 writes blocks 0 and 1
    with pytest.raises(PlanError, match="writes KV block 0"):
        admit(table, prefill(3, 1, blocks=(0,)))
    # seq 0's window has left block 0 behind: the entry stays (pointing at block 0 as padding does)
    # but no longer holds it, so seq 1 may write it; seq 0 may not write that entry again
    assert admit(table, prefill(3, 1, blocks=(0,), released_seq_index=[0], released_num_blocks=[1])).block_tables == [[0]]
    assert admit(table, decode(4, 0, start_pos=8, num_new_blocks=[1], new_block_ids=[2])).block_tables == [[0, 1, 2]]
    with pytest.raises(PlanError, match="start_pos 3 writes a released block-table entry"):
        admit(table, decode(5, 0, start_pos=3))
    admit(table, decode(5, 0, start_pos=9, released_seq_index=[0], released_num_blocks=[1]))  # a count already applied: no-op
    # seq 0 finishes: only block 1 and 2 are released with it (block 0 is seq 1's now)
    admit(table, decode(6, 1, finished=[0]))
    admit(table, prefill(7, 2, blocks=(1, 2)))
    with pytest.raises(PlanError, match="writes KV block 0"):
        admit(table, prefill(8, 3, blocks=(0,)))


@pytest.mark.parametrize(
    ("released", "message"),
    [
        (dict(released_seq_index=[1], released_num_blocks=[1]), "released_seq_index 1 names no live sequence"),
        (dict(released_seq_index=[0], released_num_blocks=[2]), "released_num_blocks 2 for seq_index 0 exceeds its block table of 1 blocks"),
        (dict(released_seq_index=[0], released_num_blocks=[1], finished=[0]), "or one finished in this step"),
        (dict(released_seq_index=[0, 0], released_num_blocks=[1, 1]), "lists a seq_index twice"),
        (dict(released_seq_index=[0]), "released_num_blocks has 0 entries, released_seq_index has 1"),
    ],
)
def test_malformed_releases_are_refused_naming_the_field(table, released, message):
    admit(table, prefill(1, 0, blocks=(0,)))
    with pytest.raises(PlanError, match=message):
        admit(table, device_pb2.StepPlan(step_id=2, **released))


def test_a_start_of_a_live_sequence_is_refused(table):
    admit(table, prefill(1, 0, blocks=(0,)))
    with pytest.raises(PlanError, match="started\\[seq_index=0\\]: the sequence is live; list it in finished first"):
        admit(table, prefill(2, 0, generation=2, blocks=(1,)))
