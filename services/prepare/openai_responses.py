"""OpenAI API response bodies built from a request's published events, for both endpoints.

:class:`ResponseBuilder` turns ``(choice index, SequenceEvent)`` pairs into the JSON objects of
OpenAI's API reference: ``chat.completion`` / ``chat.completion.chunk`` for ``/v1/chat/completions``,
``text_completion`` for ``/v1/completions`` (streamed chunks have the same shape there). Logprobs
are the pipeline's (``common.proto``'s ``TokenLogprob``: natural log, after penalties, before
temperature); a token's text is its own decoding, and ``bytes`` its UTF-8 bytes. With tools, a
chat choice's text goes through its :class:`~stageserve.prepare.tool_calls.ToolCallReader`, which
says what is content and what are ``tool_calls`` (finish_reason ``tool_calls`` when it made some);
with a reasoning parser, its :class:`~stageserve.prepare.reasoning.ReasoningReader` first takes the
``<think>`` text out as ``reasoning_content`` (vLLM's field).
With ``stream_options.continuous_usage_stats`` (vLLM's extension, with ``include_usage``) every
chunk carries the usage so far, not only the last.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stageserve.prepare.choice_text import split_choice_text
from stageserve.prepare.reasoning import ReasoningReader
from stageserve.prepare.tool_calls import ToolCallReader
from stageserve.v1 import common_pb2, reclaim_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",  # vLLM's word: the request was aborted
}


def sse(data: dict | str) -> str:
    """One server-sent event carrying ``data`` (JSON unless it is the ``[DONE]`` mark)."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


@dataclass
class _ChoiceState:
    text: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # chat: content entries; text: (token, logprob, top) triples
    finish_reason: str | None = None
    completion_tokens: int = 0
    text_offset: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    reader: ToolCallReader | None = None
    thinker: ReasoningReader | None = None

    def read(self, text: str, finished: bool) -> tuple[str, str, list[dict]]:
        """A text delta read into ``(reasoning, content, tool call deltas)`` (`split_choice_text`)."""
        return split_choice_text(self.thinker, self.reader, text, finished)

    @property
    def shown_finish_reason(self) -> str | None:
        """The finish reason a client is shown: ``tool_calls`` when the choice stopped after making some."""
        if self.finish_reason == "stop" and self.reader is not None and self.reader.calls:
            return "tool_calls"
        return self.finish_reason


class ResponseBuilder:
    """The response of one request with ``n`` choices, as chunks or whole.

    Args:
        chat: ``/v1/chat/completions`` (else ``/v1/completions``).
        request_id: served id; the response id is ``chatcmpl-<id>`` / ``cmpl-<id>``.
        model: the served model's name.
        n: choices.
        top_logprobs: alternatives to show per token; ``None`` = no logprobs.
        prompt_tokens: for usage.
        tokenizer: decodes single tokens for logprobs.
        new_reader: makes each chat choice's tool-call reader (``None``: plain text).
        continuous_usage: every streamed chunk carries the usage so far.
        new_thinker: makes each chat choice's reasoning reader (``None``: no reasoning parser).
    """

    def __init__(self, chat: bool, request_id: str, model: str, n: int, top_logprobs: int | None, prompt_tokens: int,
                 tokenizer, new_reader: Callable[[], ToolCallReader | None] = lambda: None, continuous_usage: bool = False,
                 new_thinker: Callable[[], ReasoningReader | None] = lambda: None) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())
        self.top_logprobs = top_logprobs
        self.prompt_tokens = prompt_tokens
        self._tokenizer = tokenizer
        self.continuous_usage = continuous_usage
        self._choices = [_ChoiceState(reader=new_reader(), thinker=new_thinker()) for _ in range(n)]

    # ---- streaming ----------------------------------------------------------------------------
    def first_chunks(self) -> list[dict]:
        """Chat only: each choice's opening chunk with the assistant role (as OpenAI streams it)."""
        if not self.chat:
            return []
        return [self._with_usage(self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                              "finish_reason": None}))
                for i in range(len(self._choices))]

    def chunk(self, index: int, event: reclaim_pb2.SequenceEvent, include_usage: bool) -> dict | None:
        """The chunk of one event (``None`` when it carries no text and no finish); records it too."""
        logprobs = self._record(index, event)
        state = self._choices[index]
        reasoning, text, calls = state.read(event.text, bool(event.finish_reason))
        if not (reasoning or text or calls or event.finish_reason or logprobs):
            return None
        choice: dict = {"index": index, "logprobs": logprobs, "finish_reason": state.shown_finish_reason}
        if self.chat:
            choice["delta"] = {"content": text} if text else {}
            if reasoning:
                choice["delta"]["reasoning_content"] = reasoning
            if calls:
                choice["delta"]["tool_calls"] = calls
        else:
            choice["text"] = text
        chunk = self._chunk(choice)
        if include_usage:
            chunk["usage"] = None
        return self._with_usage(chunk)

    def usage_chunk(self) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return {**self._chunk(None), "choices": [], "usage": self.usage()}

    # ---- whole --------------------------------------------------------------------------------
    def add(self, index: int, event: reclaim_pb2.SequenceEvent) -> None:
        """Record one event for :meth:`response`."""
        self._record(index, event)

    def response(self) -> dict:
        """The non-streamed response."""
        choices = []
        for index, state in enumerate(self._choices):
            text = "".join(state.text)
            logprobs = None if self.top_logprobs is None else self._logprobs_object(state.logprobs)
            content = {"message": self._message(state, text)} if self.chat else {"text": text}  # reads the tool calls first
            choices.append({"index": index, "logprobs": logprobs, "finish_reason": state.shown_finish_reason, **content})
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}

    def usage(self) -> dict:
        completion = sum(state.completion_tokens for state in self._choices)
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion, "total_tokens": self.prompt_tokens + completion}
        drafts = sum(state.draft_tokens for state in self._choices)
        if drafts:  # speculative decoding: drafts proposed and accepted (an extension of OpenAI's usage)
            usage["draft_tokens"], usage["accepted_tokens"] = drafts, sum(state.accepted_tokens for state in self._choices)
        return usage

    # ---- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _message(state: _ChoiceState, text: str) -> dict:
        """A whole chat choice's message: its text as content, or read into reasoning, content and tool calls."""
        if state.reader is None and state.thinker is None:
            return {"role": "assistant", "content": text}
        reasoning, content, _ = state.read(text, finished=True)
        message = {"role": "assistant", "content": content or None}
        if state.thinker is not None:
            message["reasoning_content"] = reasoning or None
        if state.reader is not None and state.reader.calls:
            message["tool_calls"] = state.reader.calls
        return message

    def _with_usage(self, chunk: dict) -> dict:
        if self.continuous_usage:
            chunk["usage"] = self.usage()
        return chunk

    def _chunk(self, choice: dict | None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion", "created": self.created,
                "model": self.model, "choices": [] if choice is None else [choice]}

    def _record(self, index: int, event: reclaim_pb2.SequenceEvent) -> dict | None:
        """Add ``event`` to choice ``index``; return its logprobs object (``None`` without logprobs)."""
        state = self._choices[index]
        state.text.append(event.text)
        state.completion_tokens = max(state.completion_tokens, event.completion_tokens)  # a total so far on every event
        if event.finish_reason:
            state.finish_reason = FINISH_REASONS.get(event.finish_reason, "stop")
            state.completion_tokens = event.completion_tokens
            state.draft_tokens, state.accepted_tokens = event.draft_tokens, event.accepted_tokens
        if self.top_logprobs is None or not event.logprobs:
            return None
        entries = [self._entry(state, logprob) for logprob in event.logprobs]
        state.logprobs.extend(entries)
        return self._logprobs_object(entries)

    def _entry(self, state: _ChoiceState, logprob: common_pb2.TokenLogprob):
        top = list(zip(logprob.top_token_ids, logprob.top_logprobs))[: self.top_logprobs]
        token = self._token(logprob.token_id)
        if self.chat:
            return {"token": token, "logprob": logprob.logprob, "bytes": list(token.encode()),
                    "top_logprobs": [{"token": (t := self._token(i)), "logprob": lp, "bytes": list(t.encode())} for i, lp in top]}
        offset, state.text_offset = state.text_offset, state.text_offset + len(token)
        return token, logprob.logprob, {self._token(i): lp for i, lp in top}, offset

    def _logprobs_object(self, entries: list) -> dict:
        if self.chat:
            return {"content": entries}
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": [e[3] for e in entries]}

    def _token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])
