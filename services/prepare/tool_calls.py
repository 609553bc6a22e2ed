"""Tool calling in the OpenAI-compatible API: the constraint that forces a call, and the readers
that turn a choice's generated text into OpenAI ``tool_calls`` (whole, and as streamed deltas).

``tool_choice`` (OpenAI's chat completions reference) decides how a choice's text is read:

- ``none`` (or no tools): plain text, no reader.
- ``auto``: the model may call tools in its own format; :class:`HermesReader` reads the
  Hermes / Qwen form ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (what the
  templates of Qwen2.5/3, Hermes and SmolLM3 teach), text outside the tags being the content.
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
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict]]:
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
class ArrayReader(NamedReader):
    """``tool_choice: required``: the text is a JSON array of ``{"name", "parameters"}``; sent whole
    at the end (a cut-off array is sent as content instead)."""

    def finish(self) -> tuple[str, list[dict]]:
        whole = "".join(self.text)
        try:
            items = json.loads(whole)
        except ValueError:
            return whole, []
        return "", [self._add_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


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


TOOL_CALL_PARSERS = {"hermes": HermesReader}
"""``--tool-call-parser`` choices: how ``tool_choice: auto`` reads the model's own call format."""


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
