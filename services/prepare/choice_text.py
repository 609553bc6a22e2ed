"""One choice's generated text read into reasoning, answer and tool calls, the same way for both
public APIs (the OpenAI API's ``reasoning_content`` / ``tool_calls``; gRPC's ``separate_reasoning``
/ ``parse_tool_calls``): the reasoning reader (``reasoning.py``) first, then the tool-call reader
(``tool_calls.py``) on the answer."""

from __future__ import annotations

from stageserve.prepare.reasoning import ReasoningReader
from stageserve.prepare.tool_calls import ToolCallReader


def split_choice_text(thinker: ReasoningReader | None, reader: ToolCallReader | None, text: str,
                      finished: bool) -> tuple[str, str, list[dict]]:
    """A text delta of one choice read into ``(reasoning, answer, tool call deltas)``; ``finished``:
    the choice's last delta, flush what the readers held back. Either reader may be ``None`` (no
    reasoning parser; no tools)."""
    reasoning, calls = "", []
    if thinker is not None:
        reasoning, text = thinker.feed(text) if text else ("", "")
        if finished:
            more, rest = thinker.finish()
            reasoning, text = reasoning + more, text + rest
    if reader is not None:
        text, calls = reader.feed(text) if text else ("", [])
        if finished:
            rest, more = reader.finish()
            text, calls = text + rest, calls + more
    return reasoning, text, calls
