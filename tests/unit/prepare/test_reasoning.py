"""Reasoning readers: <think> text apart from the answer, however the text is split."""

from __future__ import annotations

import pytest

from stageserve.prepare.reasoning import ReasoningReader, constrain_after_reasoning, reasoning_reader
from stageserve.v1 import common_pb2


def split(reader: ReasoningReader, text: str, piece: int) -> tuple[str, str]:
    reasoning, answer = [], []
    for start in range(0, len(text), piece):
        r, a = reader.feed(text[start:start + piece])
        reasoning.append(r)
        answer.append(a)
    r, a = reader.finish()
    return "".join(reasoning) + r, "".join(answer) + a


@pytest.mark.parametrize("piece", [1, 2, 5, 100])
@pytest.mark.parametrize("parser, text, expected", [
    ("qwen3", "<think>\nThe user greets.\n</think>\n\nHello!", ("\nThe user greets.\n", "Hello!")),
    ("qwen3", "Hello <think>!", ("", "Hello <think>!")),  # no leading <think>: all answer
    ("qwen3", "<think>still thinking", ("still thinking", "")),  # cut off while thinking
    ("deepseek_r1", "a < b so</think>Yes.", ("a < b so", "Yes.")),
    ("deepseek_r1", "<think>x</think>y", ("x", "y")),
    ("deepseek_r1", "no end", ("no end", "")),
])
def test_reasoning_and_answer_come_apart(parser, text, expected, piece):
    assert split(reasoning_reader(parser), text, piece) == expected


def test_no_parser_no_reader():
    assert reasoning_reader(None) is None


@pytest.mark.parametrize("parser, text, allowed", [
    ("deepseek_r1", 'a < b, so yes</think>\n\n{"ok": true}', True),
    ("deepseek_r1", '{"ok": true}', False),  # the template opened <think>: the reasoning must close
    ("qwen3", '<think>hmm</think>{"ok": true}', True),
    ("qwen3", '{"ok": true}', True),  # not thinking at all
    ("qwen3", '<think>hmm</think>not json', False),
])
def test_a_constraint_applies_after_the_reasoning(parser, text, allowed):
    import xgrammar

    constraint = constrain_after_reasoning(common_pb2.Constraint(json_schema='{"type": "object", "properties": {"ok": {"type": "boolean"}}}'),
                                           parser)
    grammar = xgrammar.Grammar.from_ebnf(constraint.grammar)
    assert xgrammar.testing._is_grammar_accept_string(grammar, text) == allowed
