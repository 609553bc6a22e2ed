"""The device's grammar table with real xgrammar matchers over a small byte-level vocabulary:
masks for constrained rows only, advanced by observed tokens, EOS where the grammar may end, and a
rejected token failing its row alone."""

from __future__ import annotations

import math
import time

import pytest
import torch
import xgrammar

from stageserve.device.grammar import CompiledGrammars, GrammarTable
from stageserve.device.step_plan import PlanLimits, decode_plan
from stageserve.structured_output import ConstraintError
from stageserve.v1 import common_pb2, device_pb2

VOCAB = [chr(c) for c in range(32, 127)] + ["<eos>"]  # printable ASCII, one character per token
EOS = len(VOCAB) - 1
LIMITS = PlanLimits(max_num_seqs=4, vocab_size=len(VOCAB), num_blocks=8, block_size=16, max_step_tokens=64, max_model_len=128)


def token(char: str) -> int:
    return VOCAB.index(char)


@pytest.fixture
def table() -> GrammarTable:
    compiled = []
    grammars = CompiledGrammars(lambda: xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS]),
                                on_compile=lambda cached, seconds: compiled.append(cached))
    table = GrammarTable(grammars, len(VOCAB), torch.device("cpu"))
    table.compiled = compiled
    return table


def step(step_id: int, rows: list[int], started: dict[int, common_pb2.Constraint | None] | None = None, finished=()) -> object:
    """A decode step of ``rows`` (seq_index, generation 1), starting ``started`` first."""
    plan = device_pb2.StepPlan(
        step_id=step_id, seq_index=rows, generation=[1] * len(rows), start_pos=[0] * len(rows), num_tokens=[1] * len(rows),
        token_ids=[0] * len(rows), sample=[True] * len(rows), num_new_blocks=[0] * len(rows), finished=list(finished),
        started=[common_pb2.SequenceStart(seq_index=s, generation=1, request_id=f"r{s}", constraint=c) for s, c in (started or {}).items()],
    )
    return decode_plan(plan, LIMITS, lambda sampling: None)


def allowed(table: GrammarTable, staged, rows: int = 2) -> list[list[int]]:
    logits = torch.zeros(rows, len(VOCAB))
    table.mask_logits(staged, logits)
    return [[t for t in range(len(VOCAB)) if logits[r, t] != -math.inf] for r in range(rows)]


def test_only_constrained_rows_are_masked_and_eos_comes_where_the_grammar_may_end(table):
    regex = common_pb2.Constraint(regex="ab?")
    first = table.stage(step(1, [0, 1], {0: None, 1: regex}))
    assert first.rows == [1] and table.active_count() == 1
    free, constrained = allowed(table, first)
    assert free == list(range(len(VOCAB))) and constrained == [token("a")]
    assert table.observe(first, [token("x"), token("a")]) == {}
    second = table.stage(step(2, [0, 1]))
    assert allowed(table, second)[1] == [token("b"), EOS]  # "a" is complete: EOS or one more "b"
    assert table.observe(second, [token("y"), token("b")]) == {}
    third = table.stage(step(3, [0, 1]))
    assert allowed(table, third)[1] == [EOS]
    table.observe(third, [token("z"), EOS])
    table.stage(step(4, [0], finished=[1]))
    assert table.active_count() == 0


def test_an_abort_drops_the_state_at_once(table):
    table.stage(step(1, [0, 1], {0: common_pb2.Constraint(regex="a+"), 1: common_pb2.Constraint(regex="b+")}))
    plan = step(2, [0, 1]).plan
    plan.aborted.append("r1")
    table.stage(decode_plan(plan, LIMITS, lambda sampling: None))
    assert table.active_count() == 1
    assert table.stage(step(3, [0, 1])).rows == [0]  # r1's row is free text now (reclaim discards it)


def test_a_rejected_token_fails_its_row_alone(table):
    choice = common_pb2.Constraint(choice=common_pb2.Choice(options=["yes", "no"]))
    first = table.stage(step(1, [0, 1], {0: choice, 1: choice}))
    assert allowed(table, first) == [[token("n"), token("y")]] * 2
    errors = table.observe(first, [token("y"), token("q")])  # row 1 sampled a token its grammar forbids
    assert list(errors) == [1] and "rejected sampled token" in errors[1]
    second = table.stage(step(2, [0, 1]))
    masks = allowed(table, second)
    assert masks[0] == [token("e")] and masks[1] == list(range(len(VOCAB)))  # the failed row's output is discarded
    assert table.observe(second, [token("e"), token("x")]) == {}  # reported once


def test_the_same_constraint_compiles_once_and_a_failed_step_releases_waiters(table):
    regex = common_pb2.Constraint(regex="[0-9]+")
    first = table.stage(step(1, [0, 1], {0: regex, 1: regex}))
    allowed(table, first)
    assert sorted(table.compiled) == [False, True]  # one compile, one cache hit
    table.observe(first, None)  # the step failed: its sequences fail with it, nothing waits on them
    second = table.stage(step(2, [0, 1]))
    assert allowed(table, second) == [list(range(len(VOCAB)))] * 2
    assert table.observe(second, [token("1"), token("2")]) == {}


def wide_schema(properties: int) -> common_pb2.Constraint:
    """An object schema of optional integer properties: xgrammar's compile grows much faster than
    its size (over this vocabulary 400 take ~0.1 s, 500 ~0.4 s, 600 ~0.8 s, 1,500 tens of seconds)."""
    import json

    return common_pb2.Constraint(json_schema=json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(properties)}}))


def test_a_compile_past_its_budget_is_refused_naming_it_and_at_once_when_it_comes_again():
    looks = []
    grammars = CompiledGrammars(lambda: xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS]), budget_s=0.1,
                                on_compile=lambda cached, seconds: looks.append(cached))
    with pytest.raises(ConstraintError, match="budget of 0.1 s"):
        grammars.compile_within(wide_schema(600), "team-a", wait_s=30)
    with pytest.raises(ConstraintError, match="budget of 0.1 s"):
        grammars.compile_within(wide_schema(600), "team-a", wait_s=30)
    assert looks[-1] is True  # the refusal was found in the cache: no second compile
    assert grammars.compile_within(common_pb2.Constraint(regex="a+"), "team-b", wait_s=30)[0] is False  # compiled, not cached


def test_one_tenants_slow_compiles_run_one_at_a_time_and_never_delay_another_tenants():
    """Two workers; team-a queues three slow schemas: it holds one worker, team-b's compile takes the other at once."""
    grammars = CompiledGrammars(lambda: xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS]), workers=2, budget_s=0.1)
    slow = [grammars.get(wide_schema(500 + i), "team-a") for i in range(3)]
    time.sleep(0.05)
    started = time.perf_counter()
    cached, _ = grammars.compile_within(common_pb2.Constraint(regex="[a-z]+"), "team-b", wait_s=30)
    assert not cached and time.perf_counter() - started < 0.3  # not behind team-a's ~0.4 s compiles
    assert sum(future.done() for future in slow) <= 1  # team-a's run one after another


def test_the_vocabulary_is_read_at_the_first_constraint_once_and_its_failure_names_it():
    """A device that serves no constraint never reads the vocabulary (nor imports xgrammar's
    vocabulary tables); the first compile reads it once for all; a vocabulary that cannot be read
    fails each constraint with a message that says so, not the device."""
    reads = []

    def tokenizer_info() -> xgrammar.TokenizerInfo:
        reads.append(1)
        return xgrammar.TokenizerInfo(VOCAB, stop_token_ids=[EOS])

    grammars = CompiledGrammars(tokenizer_info)
    assert reads == []
    assert grammars.compile_within(common_pb2.Constraint(regex="a+"), "", wait_s=30)[0] is False
    assert grammars.compile_within(common_pb2.Constraint(regex="b+"), "", wait_s=30)[0] is False
    assert reads == [1]

    def unreadable() -> xgrammar.TokenizerInfo:
        raise ValueError("cannot load a tokenizer from model.gguf")

    broken = CompiledGrammars(unreadable)
    with pytest.raises(ConstraintError, match="vocabulary could not be read for constraints.*cannot load a tokenizer"):
        broken.compile_within(common_pb2.Constraint(regex="a+"), "", wait_s=30)
