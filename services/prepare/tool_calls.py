"""Tool calling in the OpenAI-compatible API: the constraint that forces a call, and the readers
that turn a choice's generated text into OpenAI ``tool_calls`` (whole, and as streamed deltas).

``tool_choice`` (OpenAI's chat completions reference) decides how a choice's text is read:

- ``none`` (or no tools): plain text, no reader.
- ``auto``: the model may call tools in its own format, read by the ``--tool-call-parser``
  (``auto``: the one the chat template names, :func:`pick_tool_call_parser`): :class:`HermesReader`
  for the Hermes / Qwen form ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (what the
  templates of Qwen2.5/3, Hermes and SmolLM3 teach), text outside the tags being the content;
  :class:`LeadingJsonReader` for Llama 3's JSON and Mistral's ``[TOOL_CALLS]``.
- ``required`` or a named function: the call is forced by a JSON-schema constraint on the
  structured-output path (xgrammar), so the arguments always parse and match the schema on any
  model, whatever its template: a named function generates its arguments object itself
  (:class:`NamedReader`); ``required`` generates a JSON array of ``{"name", "parameters"}``
  objects, one item per call (one item exactly when ``parallel_tool_calls`` is false), each item
  valid against its function's schema (:class:`ArrayReader`). This is vLLM's scheme.

Streaming never emits broken JSON (vLLM issues #19056, #21544 are what happens otherwise): each
call is sent whole, in one delta, once its text is complete and parses; text that does not parse
(a call cut off by ``max_tokens``) is sent as content, so nothing generated is lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from stageserve.prepare.text_tags import partial_tag_length
from stageserve.v1 import prepare_pb2

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    """A new tool call id (OpenAI's form: ``call_`` and 24 characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _schema(tool: prepare_pb2.Tool) -> dict:
    return json.loads(tool.parameters) if tool.parameters else {"type": "object"}


def forced_call_schema(tools: list[prepare_pb2.Tool], choice: str | None, parallel: bool) -> str:
    """The JSON schema (as text) a forced call's completion must match.

    Args:
        tools: the request's tools (their ``parameters`` already checked to be JSON objects).
        choice: the named function, or ``None`` for ``required`` (any of ``tools``, at least once).
        parallel: ``required`` may make several calls (``parallel_tool_calls``, default true).
    """
    if choice is not None:
        return next(tool.parameters for tool in tools if tool.name == choice) or '{"type": "object"}'
    items = {"anyOf": [{"type": "object", "properties": {"name": {"const": tool.name}, "parameters": _schema(tool)},
                        "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]}
    schema: dict = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


@dataclass
class ToolCallReader:
    """Reads one choice's text into content and tool calls; subclasses say how.

    :meth:`feed` takes each text delta and returns what to stream now: ``(content, call deltas)``
    (call deltas in OpenAI's ``choices[i].delta.tool_calls`` form); :meth:`finish` flushes what was
    held back once the choice has ended. :attr:`calls` holds every call whole (for a unary
    response), each ``{"id", "type": "function", "function": {"name", "arguments"}}``.
    """

    calls: list[dict] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """One text delta in; ``(content, call deltas)`` to stream now out."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict]]:
        """The choice ended: ``(content, call deltas)`` of what was held back."""
        raise NotImplementedError

    def _add_call(self, name: str, arguments: str) -> dict:
        """Record a whole call and return its single stream delta."""
        call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **call}


@dataclass
class NamedReader(ToolCallReader):
    """``tool_choice`` names a function: the whole text is its arguments object (constrained);
    sent whole at the end (arguments cut off by ``max_tokens`` are sent as content instead)."""

    name: str = ""
    text: list[str] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.text.append(text)
        return "", []

    def finish(self) -> tuple[str, list[dict]]:
        whole = "".join(self.text)
        try:
            json.loads(whole)
        except ValueError:
            return whole, []
        return "", [self._add_call(self.name, whole)]


@dataclass
class ArrayReader(ToolCallReader):
    """``tool_choice: required``: the text is a JSON array of ``{"name", "parameters"}`` items (the
    constraint admits nothing else), each sent as a call once it is complete. An array cut off by
    ``max_tokens`` keeps the calls it completed; the cut item is dropped (it cannot parse, and the
    choice's ``finish_reason`` is ``length``); when no item completed, the text is sent as content.
    """

    text: str = ""
    at: int = 0  # where the next item (or the array's opening bracket) starts in ``text``

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        deltas = []
        decoder = json.JSONDecoder()
        while True:
            start = self._skip(self.at, "," if self.calls else "[")
            if start is None:
                return "", deltas
            try:
                item, end = decoder.raw_decode(self.text, start)
            except ValueError:  # not complete yet
                return "", deltas
            deltas.append(self._add_call(str(item["name"]), json.dumps(item["parameters"], ensure_ascii=False)))
            self.at = end

    def finish(self) -> tuple[str, list[dict]]:
        return ("", []) if self.calls else (self.text, [])

    def _skip(self, at: int, separator: str) -> int | None:
        """Where an item starts after white space and ``separator`` from ``at``; ``None`` when the
        text ends first or the array closed."""
        separator_seen = False
        while at < len(self.text):
            char = self.text[at]
            if char == separator and not separator_seen:
                separator_seen = True
            elif not char.isspace():
                return at if separator_seen and char == "{" else None
            at += 1
        return None


@dataclass
class HermesReader(ToolCallReader):
    """``tool_choice: auto``: ``<tool_call>{json}</tool_call>`` blocks are calls, the rest content.

    Text that could still begin ``<tool_call>`` is held back until it cannot; a block whose JSON does
    not parse (or has no ``name``) is given back as content, so nothing generated is lost. Once a
    call was made, whitespace between blocks is dropped.
    """

    pending: str = ""
    inside: bool = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, deltas = [], []
        while True:
            if self.inside:
                end = self.pending.find(HERMES_CLOSE)
                if end < 0:
                    break
                body, self.pending, self.inside = self.pending[:end], self.pending[end + len(HERMES_CLOSE):], False
                self._block(body, content, deltas)
                continue
            start = self.pending.find(HERMES_OPEN)
            if start < 0:
                keep = partial_tag_length(self.pending, HERMES_OPEN)
                content.append(self._content(self.pending[:len(self.pending) - keep]))
                self.pending = self.pending[len(self.pending) - keep:]
                break
            content.append(self._content(self.pending[:start]))
            self.pending, self.inside = self.pending[start + len(HERMES_OPEN):], True
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[dict]]:
        content, deltas = [], []
        if self.inside:  # ended without the closing tag (EOS or max_tokens): a call if its JSON is whole
            self._block(self.pending, content, deltas)
        else:
            content.append(self._content(self.pending))
        self.pending, self.inside = "", False
        return "".join(content), deltas

    def _block(self, body: str, content: list[str], deltas: list[dict]) -> None:
        try:
            parsed = json.loads(body)
            name, arguments = parsed["name"], parsed.get("arguments", parsed.get("parameters", {}))
        except (ValueError, KeyError, TypeError, AttributeError):
            content.append(HERMES_OPEN + body + (HERMES_CLOSE if not self.inside else ""))
            return
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        deltas.append(self._add_call(str(name), arguments))

    def _content(self, text: str) -> str:
        return "" if self.calls and not text.strip() else text


@dataclass
class LeadingJsonReader(ToolCallReader):
    """``tool_choice: auto`` for models whose calls are the whole answer, after a marker: Llama 3.x
    (``<|python_tag|>`` or none, then ``{"name", "parameters"}`` objects joined by ``;``) and
    Mistral (``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}``).

    Text that does not start with a marker (or, for Llama, ``{``) is content, streamed as it comes;
    text that does is held to the end and read as calls, or given back as content if it does not parse.
    """

    marker: str = ""
    bare_json: bool = False  # a leading "{" starts calls too (Llama 3 writes the marker only for built-in tools)
    pending: str = ""
    calling: bool | None = None  # None: not decided yet

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        if self.calling is None:
            start = self.pending.lstrip()
            if start.startswith(self.marker) or (self.bare_json and start.startswith("{")):
                self.calling = True
            elif start and not self.marker.startswith(start):
                self.calling = False
        if self.calling is False:
            content, self.pending = self.pending, ""
            return content, []
        return "", []

    def finish(self) -> tuple[str, list[dict]]:
        text, self.pending = self.pending, ""
        if not self.calling:
            return text, []
        try:
            calls = [(str(item["name"]), item.get("arguments", item.get("parameters", {})))
                     for item in _json_values(text.lstrip().removeprefix(self.marker))]
        except (ValueError, KeyError, TypeError, AttributeError):
            return text, []
        return "", [self._add_call(name, arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))
                    for name, arguments in calls]


def _json_values(text: str) -> list:
    """The JSON values ``text`` holds one after the other (a JSON array: its items), apart by white
    space or ``;``. Raises ValueError: something else is in between, or there are none."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        if text[at] in " \t\r\n;":
            at += 1
            continue
        value, at = decoder.raw_decode(text, at)
        values += value if isinstance(value, list) else [value]
    if not values:
        raise ValueError("no JSON value")
    return values


TOOL_CALL_PARSERS = {
    "hermes": HermesReader,
    "llama3_json": lambda: LeadingJsonReader(marker="<|python_tag|>", bare_json=True),
    "mistral": lambda: LeadingJsonReader(marker="[TOOL_CALLS]"),
}
"""``--tool-call-parser`` choices: how ``tool_choice: auto`` reads the model's own call format."""
_TEMPLATE_MARKS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"))


def pick_tool_call_parser(flag: str, template: str | None) -> str:
    """The parser of ``--tool-call-parser`` ``flag``; ``auto``: the one the chat template teaches its
    model (by the call format it names), ``hermes`` when it names none."""
    if flag != "auto":
        return flag
    return next((name for mark, name in _TEMPLATE_MARKS if template and mark in template), "hermes")


def tool_call_reader(tools: list[prepare_pb2.Tool], choice: str | None, parser: str = "hermes") -> ToolCallReader | None:
    """A new reader for one choice: ``choice`` is ``"none"``, ``"auto"``, ``"required"`` or a
    function's name; ``None`` when there are no tools or the choice is ``none``."""
    if not tools or choice == "none":
        return None
    if choice == "auto":
        return TOOL_CALL_PARSERS[parser]()
    if choice == "required":
        return ArrayReader()
    return NamedReader(name=choice)
