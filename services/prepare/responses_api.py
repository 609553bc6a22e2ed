"""OpenAI's Responses API (``POST /v1/responses``), stateless, on top of chat completions.

A Responses request is mapped onto a chat completion request (:func:`chat_body`): ``instructions``
become the system message, ``input`` items the conversation (``message`` items, and
``function_call`` / ``function_call_output`` items as an assistant's ``tool_calls`` and ``tool``
messages), function ``tools`` and ``tool_choice`` the chat ones, ``text.format`` the
``response_format``, ``max_output_tokens`` ``max_tokens``. It is then served exactly as a chat
request is, and its chat completion is turned into a ``response`` object (:func:`response_object`)
(with ``--reasoning-parser``, a ``reasoning`` item first) or, streamed, its chunks into the
Responses API's semantic events (:class:`ResponseEvents`:
``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` ... ``response.completed``, as the
OpenAI SDK's ``responses.create(stream=True)`` reads them).

Stateless: nothing is stored, so ``previous_response_id`` and ``conversation`` are refused with a
message saying to send the whole conversation in ``input``; ``store`` is ignored. Built-in tools
(web search, file search, computer use ...) and non-text inputs are refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, ClassVar, Literal, Union

from pydantic import Field

from stageserve.prepare.errors import RequestError
from stageserve.prepare.openai_protocol import TextPart, content_text
from stageserve.prepare.openai_tolerance import TolerantModel


class InputItem(TolerantModel):
    """One ``input`` item: a message (``type`` ``message`` or absent), a function call, or a call's output."""

    where: ClassVar[str] = "input"
    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["system", "developer", "user", "assistant"] = "user"
    content: Union[str, list[TextPart]] = ""
    call_id: str = ""
    name: str = ""
    arguments: str = "{}"
    output: str = ""


class FunctionTool(TolerantModel):
    """A Responses function tool (flat: ``name``, ``parameters`` beside ``type``)."""

    where: ClassVar[str] = "tools"
    type: Literal["function"]
    name: str
    description: str = ""
    parameters: dict = Field(default_factory=lambda: {"type": "object"})
    strict: bool = False


class NamedFunctionChoice(TolerantModel):
    """A Responses ``tool_choice`` naming a function: ``{"type": "function", "name"}``."""

    where: ClassVar[str] = "tool_choice"
    type: Literal["function"]
    name: str


class TextFormat(TolerantModel):
    """``text.format``: plain text, any JSON object, or a JSON schema."""

    where: ClassVar[str] = "text.format"
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "output"
    schema_: Union[dict, None] = Field(default=None, alias="schema")
    strict: bool = False


class TextOptions(TolerantModel):
    """``text``: the output's format."""

    where: ClassVar[str] = "text"
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(TolerantModel):
    """The fields of ``POST /v1/responses`` that are served (others: the tolerance policy)."""

    model: str
    input: Union[str, list[InputItem]]
    instructions: str = ""
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Union[Literal["none", "auto", "required"], NamedFunctionChoice, None] = None
    parallel_tool_calls: bool = True
    text: TextOptions = Field(default_factory=TextOptions)
    user: str = ""
    structured_outputs: dict | None = None  # vLLM's, as in chat completions


def chat_body(body: ResponsesRequest) -> dict:
    """``body`` as a ``/v1/chat/completions`` body (see the module docstring)."""
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if item.type == "message":
            messages.append({"role": item.role, "content": content_text(item.content)})
        elif item.type == "function_call":
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream, "user": body.user,
                            "parallel_tool_calls": body.parallel_tool_calls, "stream_options": {"include_usage": True}}
    for name in ("temperature", "top_p"):
        if (value := getattr(body, name)) is not None:
            chat[name] = value
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.structured_outputs is not None:
        chat["structured_outputs"] = body.structured_outputs
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
                         for t in body.tools]
    if isinstance(body.tool_choice, NamedFunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    form = body.text.format
    if form.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif form.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": form.name, "schema": form.schema_, "strict": form.strict}}
    return chat


def response_shell(body: ResponsesRequest, request_id: str, model: str) -> dict:
    """The ``response`` object's fields that echo the request (its output and usage still empty)."""
    if isinstance(body.tool_choice, NamedFunctionChoice):
        tool_choice: object = {"type": "function", "name": body.tool_choice.name}
    else:
        tool_choice = body.tool_choice or "auto"
    form = body.text.format
    text_format: dict = {"type": form.type}
    if form.type == "json_schema":
        text_format.update(name=form.name, schema=form.schema_, strict=form.strict)
    return {
        "id": f"resp_{request_id}", "object": "response", "created_at": int(time.time()), "status": "in_progress", "error": None,
        "incomplete_details": None, "instructions": body.instructions or None, "max_output_tokens": body.max_output_tokens,
        "model": model, "output": [], "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None,
        "reasoning": None, "store": False, "temperature": body.temperature, "text": {"format": text_format},
        "tool_choice": tool_choice, "tools": [t.model_dump(by_alias=True) for t in body.tools], "top_p": body.top_p,
        "truncation": "disabled", "usage": None, "user": body.user or None, "metadata": {},
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    """An assistant ``message`` output item holding ``text``."""
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(call: dict, status: str = "completed") -> dict:
    """A ``function_call`` output item of one chat tool call (``{"id", "function": {"name", "arguments"}}``)."""
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"] if status == "completed" else "",
            "status": status}


def reasoning_item(item_id: str, text: str) -> dict:
    """A ``reasoning`` output item holding the model's ``<think>`` text (``--reasoning-parser``)."""
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def response_object(completion: dict, shell: dict) -> dict:
    """The ``response`` of a whole ``chat.completion`` (one choice), on ``shell``."""
    choice = completion["choices"][0]
    message = choice["message"]
    rid = shell["id"].removeprefix("resp_")
    output = [reasoning_item(f"rs_{rid}", message["reasoning_content"])] if message.get("reasoning_content") else []
    output += [message_item(f"msg_{shell['id'].removeprefix('resp_')}", message["content"])] if message.get("content") else []
    output += [function_call_item(call) for call in message.get("tool_calls", [])]
    cut = choice["finish_reason"] == "length"
    usage = completion["usage"]
    return {**shell, "status": "incomplete" if cut else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]}}


class ResponseEvents:
    """Turns a streamed chat completion's chunks (one choice, usage last) into Responses events.

    Args:
        shell: :func:`response_shell` of the request.
        error_body: makes OpenAI's ``{"error": {...}}`` of a :class:`RequestError` raised mid-stream.
    """

    def __init__(self, shell: dict, error_body) -> None:
        self._shell = shell
        self._error_body = error_body
        self._sequence = 0
        self._message_id = f"msg_{shell['id'].removeprefix('resp_')}"
        self._output: list[dict] = []  # items done
        self._text: list[str] | None = None  # the open message item's text, None when none is open
        self._reasoning: list[str] = []  # reasoning text not yet sent

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
        """The SSE body: the opening events, one or more per chunk, the closing ``response.completed``
        (``response.incomplete`` when cut by ``max_output_tokens``); an error mid-stream is an ``error`` event."""
        yield self._event("response.created", response=self._shell)
        yield self._event("response.in_progress", response=self._shell)
        finish, usage = None, None
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    if chunk.get("usage") and not chunk["choices"]:
                        usage = chunk["usage"]
                    for choice in chunk["choices"]:
                        finish = choice["finish_reason"] or finish
                        for event in self._delta(choice["delta"]):
                            yield event
        except RequestError as error:
            body = self._error_body(error)["error"]
            yield self._event("error", code=body["code"], message=body["message"], param=body["param"])
            return
        for event in self._close_reasoning() + self._close_message():
            yield event
        calls = [{"id": item["call_id"], "function": {"name": item["name"], "arguments": item["arguments"]}}
                 for item in self._output if item["type"] == "function_call"]
        text = "".join(item["content"][0]["text"] for item in self._output if item["type"] == "message")
        completion = {"choices": [{"finish_reason": finish, "message": {"content": text, "tool_calls": calls}}], "usage": usage}
        final = response_object(completion, self._shell)
        final["output"] = self._output  # in the order streamed (the reasoning item included)
        yield self._event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)

    def _delta(self, delta: dict) -> list[str]:
        events = []
        if delta.get("reasoning_content"):  # reasoning comes first: its item is sent whole once the answer starts
            self._reasoning.append(delta["reasoning_content"])
        if delta.get("content") or delta.get("tool_calls"):
            events += self._close_reasoning()
        if delta.get("content"):
            if self._text is None:
                self._text = []
                index = len(self._output)
                events.append(self._event("response.output_item.added", output_index=index,
                                          item=message_item(self._message_id, "", "in_progress")))
                events.append(self._event("response.content_part.added", item_id=self._message_id, output_index=index, content_index=0,
                                          part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
            self._text.append(delta["content"])
            events.append(self._event("response.output_text.delta", item_id=self._message_id, output_index=len(self._output),
                                      content_index=0, delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls", []):  # each call arrives whole (tool_calls.py)
            events += self._close_message()
            item, index = function_call_item(call), len(self._output)
            events.append(self._event("response.output_item.added", output_index=index, item=function_call_item(call, "in_progress")))
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                      delta=item["arguments"]))
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=item["arguments"]))
            events.append(self._event("response.output_item.done", output_index=index, item=item))
            self._output.append(item)
        return events

    def _close_reasoning(self) -> list[str]:
        if not self._reasoning:
            return []
        item, index = reasoning_item(f"rs_{self._message_id.removeprefix('msg_')}", "".join(self._reasoning)), len(self._output)
        self._reasoning = []
        self._output.append(item)
        return [self._event("response.output_item.added", output_index=index, item={**item, "status": "in_progress"}),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _close_message(self) -> list[str]:
        if self._text is None:
            return []
        text, index = "".join(self._text), len(self._output)
        item = message_item(self._message_id, text)
        self._text = None
        self._output.append(item)
        return [
            self._event("response.output_text.done", item_id=self._message_id, output_index=index, content_index=0, text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=self._message_id, output_index=index, content_index=0,
                        part=item["content"][0]),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _event(self, kind: str, **fields) -> str:
        self._sequence += 1
        data = json.dumps({"type": kind, "sequence_number": self._sequence - 1, **fields}, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"

