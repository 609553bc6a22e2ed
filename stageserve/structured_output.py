"""Structured-output constraints as both prepare and the device read them: bounds, the xgrammar
grammar of each kind, and xgrammar's errors made readable.

A `common_pb2.Constraint` holds one kind (``json_schema``, ``json_object``, ``regex``, ``grammar``,
``choice``). `constraint_grammar` turns it into an ``xgrammar.Grammar``, the one place where the
kinds are interpreted: prepare calls it to refuse a bad constraint before admission
(no tokenizer needed: ~0.2 ms for a mid-sized schema, and cached); the device compiles the
same grammar against the model's vocabulary (`stageserve.device.grammar`). JSON is generated
compact (``any_whitespace=False``: ``", "`` and ``": "`` separators, no free whitespace), so a
sampled completion cannot spend its tokens on whitespace.

xgrammar is imported at the first parse, not with this module: it imports torch (about 200 MiB), which
a prepare serving no constrained request then never loads.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING

from stageserve.v1 import common_pb2

if TYPE_CHECKING:
    import xgrammar

MAX_CONSTRAINT_CHARS = 65536
"""Characters of a json_schema, regex or grammar, and of a choice's options together, at most."""
MAX_CHOICE_OPTIONS = 256
"""Options of a choice constraint, at most."""
MAX_JSON_DEPTH = 64
"""Nesting of a JSON value a client sends (a ``json_schema``, tool parameters, template kwargs), at
most: objects and arrays inside each other, ``{}`` being 1. Refused before compiling: a schema's
compile time (which the device spends) and the parsers' recursion grow with its depth."""
JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""``json_object``: any JSON object (xgrammar's strict mode still allows any property here)."""

# xgrammar's messages start with a log prefix ("[11:01:01] /project/cpp/x.cc:94: ") and sometimes
# a failed-check preamble; neither helps a client.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_CHECK_PREAMBLE = re.compile(r"^Check failed: \(.*?\) is false: ")


class ConstraintError(ValueError):
    """A constraint that cannot be used; the message starts with the field (``constraint.regex: ...``)."""


def constraint_kind(constraint: common_pb2.Constraint | None) -> str | None:
    """The kind set in ``constraint`` (``json_schema`` ...), or ``None`` when none is (unconstrained)."""
    return None if constraint is None else constraint.WhichOneof("kind")


def constraint_grammar(constraint: common_pb2.Constraint) -> xgrammar.Grammar:
    """The xgrammar ``Grammar`` of ``constraint`` (see the module docstring for the JSON style).

    Raises:
        ConstraintError: no kind set, a bound exceeded, or xgrammar refuses the text; the message
            names the field and says what is wrong (xgrammar's own words, without its log prefix).
    """
    kind = constraint_kind(constraint)
    if kind is None:
        raise ConstraintError("constraint: set one of json_schema, json_object, regex, grammar, choice")
    field = f"constraint.{kind}"
    if kind == "json_object" and not constraint.json_object:
        raise ConstraintError(f"{field}: false is not a constraint; leave constraint unset for free text")
    text = _source_text(constraint, kind)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ConstraintError(f"{field}: {len(text)} characters is more than the maximum of {MAX_CONSTRAINT_CHARS}")
    try:
        return _parse("json" if kind in ("json_schema", "json_object") else kind, text)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ConstraintError(f"{field}: {readable_error(exc)}") from None


@functools.lru_cache(maxsize=256)
def _parse(syntax: str, text: str) -> xgrammar.Grammar:
    """xgrammar's parse of ``text`` as ``json`` (a schema), ``regex`` or EBNF; cached, as the same
    schema usually comes again (a failed parse raises and is not cached)."""
    import xgrammar

    if syntax == "json":
        return xgrammar.Grammar.from_json_schema(text, any_whitespace=False)
    if syntax == "regex":
        return xgrammar.Grammar.from_regex(text)
    return xgrammar.Grammar.from_ebnf(text)


def readable_error(exc: BaseException) -> str:
    """xgrammar's message of ``exc`` without its log prefix, on one line."""
    lines = [_CHECK_PREAMBLE.sub("", _LOG_PREFIX.sub("", line.strip())) for line in str(exc).strip().splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


def _source_text(constraint: common_pb2.Constraint, kind: str) -> str:
    """The text xgrammar parses: the field itself, or the schema / EBNF a kind stands for."""
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if kind != "choice":
        text = getattr(constraint, kind)
        if not text:
            raise ConstraintError(f"constraint.{kind}: empty; give the {kind.replace('_', ' ')} text")
        if kind == "json_schema":
            _check_json(text)
        return text
    options = constraint.choice.options
    if not options:
        raise ConstraintError("constraint.choice.options: empty; give at least one option")
    if len(options) > MAX_CHOICE_OPTIONS:
        raise ConstraintError(f"constraint.choice.options: {len(options)} options is more than the maximum of {MAX_CHOICE_OPTIONS}")
    for i, option in enumerate(options):
        if not option:
            raise ConstraintError(f"constraint.choice.options[{i}]: empty; every option needs at least one character")
    # JSON string escapes are EBNF string-literal escapes in xgrammar's dialect.
    return "root ::= " + " | ".join(json.dumps(option) for option in options)


def nested_deeper_than(value: object, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests objects and arrays more than ``limit`` deep (iterative:
    no recursion limit of its own)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def too_deep(field: str, limit: int = MAX_JSON_DEPTH) -> str:
    """The refusal of a JSON value of ``field`` nested deeper than ``limit``."""
    return f"{field}: nested deeper than the maximum of {limit} levels of objects and arrays"


def _check_json(text: str) -> None:
    """Python's JSON parser names line and column, which xgrammar's message does not; the depth is
    checked before xgrammar (whose converter recurses) sees the schema."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"constraint.json_schema: not JSON ({exc})") from None
    except RecursionError:  # deeper than the parser's own recursion allows: far past the limit
        raise ConstraintError(too_deep("constraint.json_schema")) from None
    if nested_deeper_than(schema, MAX_JSON_DEPTH):
        raise ConstraintError(too_deep("constraint.json_schema"))
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"constraint.json_schema: a schema is a JSON object (or true/false), got {type(schema).__name__}")
