"""The constraint kinds as xgrammar grammars, their bounds, and xgrammar's errors made readable."""

from __future__ import annotations

import json

import pytest
import xgrammar

from stageserve.structured_output import (MAX_CHOICE_OPTIONS, MAX_CONSTRAINT_CHARS, MAX_JSON_DEPTH, ConstraintError, constraint_grammar,
                                         nested_deeper_than)
from stageserve.v1 import common_pb2


def accepts(constraint: common_pb2.Constraint, text: str) -> bool:
    """Whether ``text`` is a complete sentence of the constraint (xgrammar's byte-level matcher)."""
    tokenizer = xgrammar.TokenizerInfo([chr(c) for c in range(32, 127)] + ["<eos>"], stop_token_ids=[95])
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(tokenizer).compile_grammar(constraint_grammar(constraint)))
    return matcher.accept_string(text) and matcher.is_completed()


def test_json_is_compact_and_follows_the_schema():
    schema = common_pb2.Constraint(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    assert accepts(schema, '{"a": 12}')
    assert not accepts(schema, '{ "a": 12 }') and not accepts(schema, '{"a": "x"}')
    assert accepts(common_pb2.Constraint(json_object=True), '{"k": [1, {"n": null}]}')
    assert not accepts(common_pb2.Constraint(json_object=True), "[1]")


def test_choice_options_are_literals_even_with_quotes_and_backslashes():
    options = ["yes", 'say "no"', "back\\slash", "naïve"]
    choice = common_pb2.Constraint(choice=common_pb2.Choice(options=options))
    assert all(accepts(choice, option) for option in options[:3])
    assert not accepts(choice, "ye") and not accepts(choice, "yesno")


def test_regex_and_grammar():
    assert accepts(common_pb2.Constraint(regex="[0-9]{2}-[a-z]+"), "42-ab")
    assert not accepts(common_pb2.Constraint(regex="[0-9]{2}-[a-z]+"), "4-ab")
    assert accepts(common_pb2.Constraint(grammar='root ::= "(" root ")" | "x"'), "((x))")


@pytest.mark.parametrize("constraint, message", [
    (common_pb2.Constraint(), "constraint: set one of json_schema, json_object, regex, grammar, choice"),
    (common_pb2.Constraint(json_object=False), "constraint.json_object: false is not a constraint"),
    (common_pb2.Constraint(json_schema=""), "constraint.json_schema: empty"),
    (common_pb2.Constraint(json_schema="[1]"), "constraint.json_schema: a schema is a JSON object (or true/false), got list"),
    (common_pb2.Constraint(json_schema='{"type": "object", "properties": 3}'), "constraint.json_schema: properties must be an object"),
    (common_pb2.Constraint(regex="(a"), "constraint.regex: Regex parsing error at position 3: The parenthesis is not closed."),
    (common_pb2.Constraint(regex="(?=a)b"), "constraint.regex: Regex parsing error at position 3: Lookahead is not supported yet."),
    (common_pb2.Constraint(grammar='root ::= "a" |'), "constraint.grammar: EBNF parser error at line 1, column 15: Expect element"),
    (common_pb2.Constraint(regex="a" * (MAX_CONSTRAINT_CHARS + 1)), f"constraint.regex: {MAX_CONSTRAINT_CHARS + 1} characters is more than"),
    (common_pb2.Constraint(choice=common_pb2.Choice(options=["a", ""])), "constraint.choice.options[1]: empty"),
    (common_pb2.Constraint(choice=common_pb2.Choice(options=["a"] * (MAX_CHOICE_OPTIONS + 1))), "constraint.choice.options: 257 options"),
])
def test_bad_constraints_name_the_field_in_xgrammars_words(constraint, message):
    with pytest.raises(ConstraintError) as refused:
        constraint_grammar(constraint)
    assert str(refused.value).startswith(message), str(refused.value)
    assert "/project/cpp" not in str(refused.value) and "\n" not in str(refused.value)


def nested_schema(levels: int) -> str:
    """A schema of ``levels`` objects each holding the next as property ``a`` (2 JSON levels each)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + '}, "required": ["a"]}' * levels  # linear time


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH // 2, 700, 100_000])
def test_a_schema_nested_past_the_depth_limit_is_refused_before_compiling(levels):
    constraint = common_pb2.Constraint(json_schema=nested_schema(levels))
    if levels * 2 + 1 <= MAX_JSON_DEPTH:  # 2 JSON levels a schema level, and the innermost {"type": "string"}
        constraint_grammar(constraint)
        return
    with pytest.raises(ConstraintError, match=f"constraint.json_schema: nested deeper than the maximum of {MAX_JSON_DEPTH} levels"):
        constraint_grammar(constraint)


def test_nested_deeper_than_counts_objects_and_arrays():
    assert not nested_deeper_than({"a": [1, {"b": []}]}, 4) and nested_deeper_than({"a": [1, {"b": []}]}, 3)
    assert not nested_deeper_than("text", 0) and not nested_deeper_than({}, 1) and nested_deeper_than([[]], 1)
