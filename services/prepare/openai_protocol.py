"""The OpenAI API's request bodies (pydantic models) and their mapping onto ``GenerateRequest``.

What stageserve serves is declared here; any other field follows the tolerance policy
(``openai_tolerance.py``, ``docs/openai-api.md``): ignored when it cannot change the result,
refused with a 400 naming it when it would (``best_of > 1``, ``audio``, ...), and so is a
declared field with a value stageserve does not serve (an image content part, several prompts).
A field sent as ``null`` counts as not sent, as in OpenAI's API. The ``developer`` role is taken
as ``system`` (as vLLM does). Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``, the
``tool`` role, assistant ``tool_calls``) go to the chat template; ``tool_choice`` required or a
named function adds the constraint that forces the call (``tool_calls.py``); vLLM's
``chat_template_kwargs`` become template variables. Field meanings follow OpenAI's API reference
(``/v1/chat/completions``, ``/v1/completions``); besides them, vLLM's sampling extensions
``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``
and ``include_stop_str_in_output`` are accepted, with the gRPC API's meanings. Range checks are
not made here: ``validation.py`` makes them for both APIs (and names the field in its message).

Structured output: OpenAI's ``response_format`` (``{"type": "json_object"}``, or ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}``; ``text`` = none) and vLLM's
``structured_outputs`` (one of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar``) map
onto ``GenerateRequest.constraint``; a ``json_schema`` without ``schema`` is any JSON object.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal, Union

from pydantic import Field

from stageserve.prepare.errors import invalid_argument
from stageserve.prepare.openai_tolerance import TolerantModel
from stageserve.prepare.tool_calls import forced_call_schema
from stageserve.structured_output import ConstraintError, constraint_grammar
from stageserve.v1 import common_pb2, prepare_pb2

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""``/v1/completions`` without ``max_tokens`` generates this many tokens at most (OpenAI's default)."""

# OpenAI's top_logprobs / completions logprobs maximum is 20 (chat) and 5 (completions); prepare
# allows 20 for both (sampling_rules.MAX_LOGPROBS) and refuses more there.


class StreamOptions(TolerantModel):
    """``stream_options``: the usage chunk at the end, and (vLLM) usage in every chunk."""

    where: ClassVar[str] = "stream_options"
    include_usage: bool = False
    # vLLM's: usage (so far) in every chunk, not only in the last one
    continuous_usage_stats: bool = False


class TextPart(TolerantModel):
    """A text content part, of chat messages and of Responses input items alike."""

    where: ClassVar[str] = "content"
    # "refusal" (an assistant message's refusal text, sent back in the history) reads as text
    type: Literal["text", "input_text", "output_text", "refusal"]
    text: str = ""
    refusal: str = ""


def content_text(content: Union[str, list[TextPart]]) -> str:
    """A message's content as one string (text parts joined)."""
    return content if isinstance(content, str) else "".join(part.text or part.refusal for part in content)


class FunctionCall(TolerantModel):
    """The function an assistant's tool call called: its name and arguments (JSON text)."""

    where: ClassVar[str] = "messages.tool_calls.function"
    name: str
    arguments: str = "{}"


class AssistantToolCall(TolerantModel):
    """One of an assistant message's ``tool_calls`` in the history."""

    where: ClassVar[str] = "messages.tool_calls"
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(TolerantModel):
    """One message of ``messages`` (OpenAI's roles; ``developer`` is taken as ``system``)."""

    where: ClassVar[str] = "messages"
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart]] = ""
    name: str = ""
    tool_calls: list[AssistantToolCall] = Field(default_factory=list)
    tool_call_id: str = ""

    def grpc(self) -> prepare_pb2.ChatMessage:
        """This message as the gRPC API's ``ChatMessage`` (``developer`` as ``system``)."""
        return prepare_pb2.ChatMessage(
            role="system" if self.role == "developer" else self.role, content=content_text(self.content), name=self.name,
            tool_call_id=self.tool_call_id,
            tool_calls=[prepare_pb2.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments) for c in self.tool_calls])


class FunctionDefinition(TolerantModel):
    """A tool's function: name, description, JSON schema of its arguments."""

    where: ClassVar[str] = "tools.function"
    name: str = Field(min_length=1, max_length=64)
    description: str = ""
    parameters: dict = Field(default_factory=lambda: {"type": "object"})
    strict: bool = False  # the arguments always match the schema where a call is forced; auto calls as the model makes them


class ToolDefinition(TolerantModel):
    """One of ``tools`` (functions only)."""

    where: ClassVar[str] = "tools"
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(TolerantModel):
    """The function a named ``tool_choice`` forces."""

    where: ClassVar[str] = "tool_choice.function"
    name: str


class NamedToolChoice(TolerantModel):
    """``tool_choice`` naming a function: ``{"type": "function", "function": {"name"}}``."""

    where: ClassVar[str] = "tool_choice"
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(TolerantModel):
    """``response_format.json_schema``."""

    where: ClassVar[str] = "response_format.json_schema"
    name: str
    description: str = ""
    schema_: Union[dict, bool, None] = Field(default=None, alias="schema")
    strict: bool = False


class ResponseFormat(TolerantModel):
    """OpenAI's ``response_format``."""

    where: ClassVar[str] = "response_format"
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(TolerantModel):
    """vLLM's ``structured_outputs``: set one field."""

    where: ClassVar[str] = "structured_outputs"
    json_: Union[str, dict, bool, None] = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(TolerantModel):
    """Fields both endpoints share."""

    model: str
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] = Field(default_factory=dict)
    max_tokens: int | None = None
    n: int | None = None
    seed: int | None = None
    stop: Union[str, list[str]] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str = ""  # for the logs (prepare's GenerateRequest.user)
    # vLLM's extensions
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ToolDefinition] = Field(default_factory=list)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)  # vLLM's

    @property
    def tool_mode(self) -> str:
        """``none``, ``auto``, ``required`` or the named function (OpenAI's default: auto with tools, none without)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return self.tool_choice or ("auto" if self.tools else "none")


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None


def _common_fields(body: SamplingFields, max_tokens: int | None) -> prepare_pb2.GenerateRequest:
    """The ``GenerateRequest`` of the fields both endpoints share (prompt and logprobs left to the caller)."""
    request = prepare_pb2.GenerateRequest(
        top_k=_unsigned("top_k", body.top_k), min_p=body.min_p, ignore_eos=body.ignore_eos,
        min_tokens=_unsigned("min_tokens", body.min_tokens),
        include_stop_str_in_output=body.include_stop_str_in_output, stop_token_ids=_token_ids("stop_token_ids", body.stop_token_ids),
        stop=[body.stop] if isinstance(body.stop, str) else body.stop,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, user=body.user,
    )
    for key, bias in body.logit_bias.items():
        if not key.lstrip("-").isdigit():
            raise invalid_argument(f"logit_bias: key {key!r} is not a token id; use token ids as keys")
        request.logit_bias[_token_ids("logit_bias", [int(key)])[0]] = bias
    for field in ("temperature", "top_p", "repetition_penalty"):
        if (value := getattr(body, field)) is not None:
            setattr(request, field, value)
    if max_tokens is not None:
        request.max_tokens = _unsigned("max_tokens", max_tokens)
    if body.n is not None:
        request.n = _unsigned("n", body.n)
    if body.seed is not None:
        request.seed = body.seed & ((1 << 64) - 1)  # a negative seed keeps its bits
    if (constraint := _constraint(body)) is not None:
        request.constraint.CopyFrom(constraint)
    return request


def _constraint(body: SamplingFields) -> common_pb2.Constraint | None:
    """``response_format`` or ``structured_outputs`` as a ``Constraint`` (checked later by validation)."""
    form, outputs = body.response_format, body.structured_outputs
    if form is not None and form.type != "text" and outputs is not None:
        raise invalid_argument("response_format: cannot be combined with structured_outputs; set one of them")
    if outputs is not None:
        return _structured_outputs(outputs)
    if form is None or form.type == "text":
        return None
    if form.type == "json_schema" and form.json_schema is None:
        raise invalid_argument("response_format.json_schema: required with type json_schema; give {name, schema}")
    if form.type == "json_object" or form.json_schema.schema_ is None:
        return common_pb2.Constraint(json_object=True)
    return common_pb2.Constraint(json_schema=json.dumps(form.json_schema.schema_))


def _structured_outputs(outputs: StructuredOutputs) -> common_pb2.Constraint:
    given = [name for name in ("json_", "json_object", "regex", "choice", "grammar") if getattr(outputs, name) is not None]
    if len(given) != 1:
        raise invalid_argument(f"structured_outputs: set exactly one of json, json_object, regex, choice, grammar; got {len(given)}")
    name = given[0]
    value = getattr(outputs, name)
    if name == "json_":
        return common_pb2.Constraint(json_schema=value if isinstance(value, str) else json.dumps(value))
    if name == "choice":
        return common_pb2.Constraint(choice=common_pb2.Choice(options=value))
    return common_pb2.Constraint(**{name: value})


def chat_request(body: ChatCompletionRequest) -> prepare_pb2.GenerateRequest:
    """``body`` as the gRPC API's ``GenerateRequest`` (messages rendered by the chat template).

    Raises:
        RequestError: ``INVALID_ARGUMENT`` for a value stageserve does not serve.
    """
    if body.max_tokens is not None and body.max_completion_tokens is not None and body.max_tokens != body.max_completion_tokens:
        raise invalid_argument("max_completion_tokens: differs from max_tokens; set one of them")
    request = _common_fields(body, body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens)
    request.messages.extend(m.grpc() for m in body.messages)
    if body.chat_template_kwargs:
        request.chat_template_kwargs = json.dumps(body.chat_template_kwargs)
    _add_tools(body, request)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid_argument("top_logprobs: needs logprobs: true")
    # OpenAI returns the sampled token's logprob with logprobs alone; prepare returns top-n with
    # the sampled one, so top_logprobs 0 still asks for one alternative and shows none.
    if body.logprobs:
        request.logprobs = max(1, _unsigned("top_logprobs", body.top_logprobs or 0))
    return request


def _add_tools(body: ChatCompletionRequest, request: prepare_pb2.GenerateRequest) -> None:
    """The request's tools, for the chat template, and the constraint of a forced call."""
    mode = body.tool_mode
    if mode != "none" and not body.tools:
        raise invalid_argument(f"tool_choice: {mode!r} needs tools; send tools or leave tool_choice unset")
    if mode == "none":  # OpenAI still shows the tools to the model; it is asked not to call them
        request.tools.extend(_grpc_tool(t) for t in body.tools)
        return
    names = [tool.function.name for tool in body.tools]
    if mode not in ("auto", "required") and mode not in names:
        raise invalid_argument(f"tool_choice.function.name: {mode!r} is not among tools ({', '.join(names)}); name one of them")
    if len(set(names)) != len(names):
        raise invalid_argument("tools: two functions share a name; give each its own")
    request.tools.extend(_grpc_tool(t) for t in body.tools)
    if mode == "auto":
        return
    if body.response_format is not None and body.response_format.type != "text" or body.structured_outputs is not None:
        raise invalid_argument("tool_choice: a forced call cannot be combined with response_format or structured_outputs; set one")
    request.constraint.json_schema = forced_call_schema(list(request.tools), None if mode == "required" else mode,
                                                        body.parallel_tool_calls)
    try:  # here, to name the field the client sent (validation parses it again, from xgrammar's cache)
        constraint_grammar(request.constraint)
    except ConstraintError as exc:
        raise invalid_argument(f"tools: the parameters cannot constrain a forced call ({str(exc).split(': ', 1)[-1]}); "
                               "give a JSON schema of an object") from None


def _grpc_tool(tool: ToolDefinition) -> prepare_pb2.Tool:
    function = tool.function
    return prepare_pb2.Tool(name=function.name, description=function.description, parameters=json.dumps(function.parameters))


def completion_request(body: CompletionRequest) -> prepare_pb2.GenerateRequest:
    """``body`` as the gRPC API's ``GenerateRequest`` (the prompt tokenized as is).

    Raises:
        RequestError: ``INVALID_ARGUMENT`` for a value stageserve does not serve.
    """
    request = _common_fields(body, DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise invalid_argument(f"prompt: a list of {len(prompt)} prompts; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(_token_ids("prompt", prompt))
    if body.logprobs is not None:
        # The sampled token's logprob comes with any top-n; 0 asks for the sampled one alone.
        request.logprobs = max(1, _unsigned("logprobs", body.logprobs))
    return request


UINT32_MAX = 2**32 - 1
INT32_RANGE = (-(2**31), 2**31 - 1)


def _unsigned(field: str, value: int) -> int:
    """``value`` if it fits the wire's uint32, else INVALID_ARGUMENT naming ``field`` (a larger one
    would make the protobuf assignment raise, a 500)."""
    if value < 0:
        raise invalid_argument(f"{field}: {value} is negative; use a value >= 0")
    if value > UINT32_MAX:
        raise invalid_argument(f"{field}: {value} is too large; use a value <= {UINT32_MAX}")
    return value


def _token_ids(field: str, ids: list[int]) -> list[int]:
    """``ids`` if each fits the wire's int32 (the vocabulary check comes later), else INVALID_ARGUMENT naming ``field``."""
    low, high = INT32_RANGE
    for token_id in ids:
        if not low <= token_id <= high:
            raise invalid_argument(f"{field}: token id {token_id} is out of range; token ids are below the vocabulary size")
    return ids


class TokenizeBody(TolerantModel):
    """vLLM's ``POST /tokenize``: one of ``prompt`` and ``messages`` (rendered as a chat request would be)."""

    model: str = ""
    prompt: str = ""
    messages: list[ChatMessage] = Field(default_factory=list)
    add_special_tokens: bool = True  # prompt only: the tokenizer's own special tokens (a BOS), as Generate adds them
    return_token_strs: bool = False


class DetokenizeBody(TolerantModel):
    """vLLM's ``POST /detokenize``: token ids to text."""

    model: str = ""
    tokens: list[int]


class EmbeddingsBody(TolerantModel):
    """OpenAI's ``POST /v1/embeddings``: ``input`` a text, texts, token ids or lists of token ids.

    ``dimensions`` other than the model's hidden size is refused (the vectors are not truncated:
    that suits only Matryoshka-trained models); ``encoding_format`` base64 is the float32
    little-endian bytes of each vector, what the ``openai`` SDK asks for by default.
    """

    model: str = ""
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None

    def grpc(self, request_id: str) -> prepare_pb2.EmbedRequest:
        """The gRPC ``EmbedRequest`` of this body."""
        inputs = [self.input] if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)) else self.input
        if inputs and isinstance(inputs[0], str):
            return prepare_pb2.EmbedRequest(request_id=request_id, input=inputs)
        return prepare_pb2.EmbedRequest(request_id=request_id, input_token_ids=[prepare_pb2.TokenIds(token_ids=ids) for ids in inputs])
