"""Turn a public ``GenerateRequest`` into a validated :class:`GenerationRequest`, or refuse it.

Every refusal is a :class:`RequestError` with ``INVALID_ARGUMENT`` whose message names the field
and the allowed values, so a client knows what to change. The size bounds of every field
(``limits.py``) are checked first, before any tokenization.

Defaults (the public API's documented ones, made concrete here so the device and reclaim see
exact values):

- ``max_tokens``: ``min(256, max_model_len - prompt_tokens)``; an explicit value is never
  capped: ``prompt_tokens + max_tokens > max_model_len`` is refused, naming both numbers.
- ``temperature`` 1.0, ``top_p`` 1.0, ``repetition_penalty`` 1.0 (off), ``n`` 1.
- ``seed``: a random 63-bit number per request (63 bits so it also fits a signed 64-bit integer).

A ``constraint`` (structured output) is parsed here, so a bad schema, regex or grammar is refused
before admission; the device compiles it (``stageserve.device.grammar``).

Prompt forms: ``prompt`` is tokenized as is (with the tokenizer's own special tokens, e.g. a
BOS for llama-family tokenizers); ``messages`` are rendered with the model's chat template
(``apply_chat_template(..., add_generation_prompt=True)``, with the request's ``tools`` and
``chat_template_kwargs``), then tokenized without adding special
tokens again; ``prompt_token_ids`` are taken as given after a range check.
"""

from __future__ import annotations

import functools
import json
import secrets
from dataclasses import dataclass
from typing import Sequence

from stageserve.prepare.errors import invalid_argument
from stageserve.process_memory import return_freed_memory
from stageserve.prepare.limits import MAX_CHOICES, MAX_REQUEST_ID_CHARS, at_most, check_generate_bounds
from stageserve.sampling_rules import first_violation, logit_bias_problem
from stageserve.security.keys import NO_LIMITS, TenantLimits
from stageserve.structured_output import MAX_JSON_DEPTH, ConstraintError, constraint_grammar, nested_deeper_than, too_deep
from stageserve.v1 import common_pb2, prepare_pb2

DEFAULT_MAX_TOKENS = 256
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model (from the device's ``AttachReply``).

    Attributes:
        vocab_size: token ids are ``[0, vocab_size)``.
        max_model_len: context length in tokens (prompt + completion).
    """

    vocab_size: int
    max_model_len: int


@dataclass(frozen=True, eq=False)
class GenerationRequest:
    """A validated request, ready for the scheduler; identity (``is``) tells two requests apart.

    Attributes:
        request_id: the client's id (or a generated one).
        prompt_token_ids: the prompt, ``len >= 1``.
        max_tokens: completion tokens at most, ``>= 1``, ``prompt + max_tokens <= max_model_len``.
        sampling: concrete sampling parameters for the device.
        stop: stop conditions for reclaim (``max_tokens`` and ``prompt_tokens`` filled in).
        cache_salt: prefix-cache blocks are shared only between requests of the same salt.
        cache_tenant: ... and of the same tenant: the API key's name under ``--prefix-cache-sharing
            per-key`` (the default), "" without keys or with ``shared``.
        constraint: the structured-output constraint, checked (it parses); ``None`` = free text.
        tenant: the API key's name ("" without keys): whose turns its tokenization, grammar compile
            and admission take.
        tenant_limits: what that key's requests may hold (its keys-file line's limits).
        pooling: an embedding's pooling (``common_pb2.Pooling``, ``embeddings.py``); NONE = a generation.
        output_offset: a resumed request (``resumption.py``): its prompt's last tokens that are its own output.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: common_pb2.SamplingParams
    stop: common_pb2.StopParams
    cache_salt: str = ""
    cache_tenant: str = ""
    constraint: common_pb2.Constraint | None = None
    tenant: str = ""
    tenant_limits: TenantLimits = NO_LIMITS
    pooling: int = common_pb2.POOLING_NONE
    output_offset: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def validate_request_id(request_id: str) -> str:
    """Check a client-chosen request id (field or ``x-request-id``).

    Raises:
        RequestError: ``INVALID_ARGUMENT`` when it is longer than 256 characters or not printable
            ASCII (it travels in the ``x-request-id`` header).
    """
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise invalid_argument(f"request_id: {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed")
    if not all(" " <= ch <= "~" for ch in request_id):
        raise invalid_argument(f"request_id: {request_id!r} holds characters outside printable ASCII; use letters, digits and punctuation")
    return request_id


OWNER_SEPARATOR = "\u00a7"
"""Between an API key's name and the client's id in a scoped id (``team-a§req-1``): a character no
client id holds (they are printable ASCII), so no two (owner, id) pairs give the same scoped id."""


def scoped_request_id(owner: str, request_id: str) -> str:
    """The id the scheduler knows a request by: ``request_id`` of the key named ``owner`` ("" = no keys: unscoped)."""
    return f"{owner}{OWNER_SEPARATOR}{request_id}" if owner else request_id


def client_request_id(scoped_id: str) -> str:
    """The id the client chose, from a :func:`scoped_request_id` (for messages to that client)."""
    return scoped_id.rpartition(OWNER_SEPARATOR)[2]


def render_chat(messages: Sequence[prepare_pb2.ChatMessage], tokenizer, tools: Sequence[prepare_pb2.Tool] = (),
                template_kwargs: str = "") -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template, ending with the
    assistant's generation prompt; ``tools`` go to the template as transformers' ``tools=``,
    assistant tool calls as ``tool_calls`` (arguments parsed), and ``template_kwargs`` (a JSON
    object) as extra template variables.

    Raises:
        RequestError: ``INVALID_ARGUMENT`` for an unknown role, tool arguments or a schema that
            are not JSON, or when the template rejects the messages (e.g. a template that requires
            alternating roles).
    """
    conversation = [_template_message(i, m) for i, m in enumerate(messages)]
    extra = _json_field("chat_template_kwargs", template_kwargs, dict) if template_kwargs else {}
    for reserved in ("conversation", "messages", "tools", "tokenize", "add_generation_prompt"):
        if reserved in extra:
            raise invalid_argument(f"chat_template_kwargs.{reserved}: set by the server; remove it")
    template_tools = [{"type": "function", "function": {
        "name": tool.name, "description": tool.description,
        "parameters": _json_field(f"tools[{i}].parameters", tool.parameters, dict) if tool.parameters else {"type": "object"}}}
        for i, tool in enumerate(tools)]
    try:
        text = tokenizer.apply_chat_template(conversation, tools=template_tools or None, add_generation_prompt=True, tokenize=False,
                                             **extra)
    except Exception as exc:  # jinja2 errors, or "no chat template" from transformers
        raise invalid_argument(f"messages: the model's chat template cannot render them ({exc}); send a raw prompt instead") from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


def _template_message(index: int, message: prepare_pb2.ChatMessage) -> dict:
    """``message`` as a chat template reads it (transformers' convention: tool arguments as a dict)."""
    if message.role not in CHAT_ROLES:
        raise invalid_argument(f"messages[{index}].role: {message.role!r} is not one of {', '.join(CHAT_ROLES)}")
    rendered: dict = {"role": message.role, "content": message.content}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": _json_field(f"messages[{index}].tool_calls[{j}].arguments", call.arguments or "{}", dict)}}
            for j, call in enumerate(message.tool_calls)]
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name:
        rendered["name"] = message.name
    return rendered


def _json_field(field: str, text: str, kind: type) -> object:
    """``text`` parsed as JSON of type ``kind``. Raises RequestError (``INVALID_ARGUMENT``) naming ``field``."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise invalid_argument(f"{field}: not valid JSON ({exc})") from None
    except RecursionError:
        raise invalid_argument(too_deep(field)) from None
    if nested_deeper_than(value, MAX_JSON_DEPTH):
        raise invalid_argument(too_deep(field))
    if not isinstance(value, kind):
        raise invalid_argument(f"{field}: must be a JSON {'object' if kind is dict else kind.__name__}, got {type(value).__name__}")
    return value


LARGE_PROMPT_TOKENS = 65536
"""A tokenization of at least this many tokens gives its freed memory back to the system."""


def release_freed_memory(num_tokens: int) -> None:
    """After a tokenization of ``num_tokens`` tokens, hand the memory its tokenizer freed back to the
    system (glibc's ``malloc_trim``) when it was large: a 1 MiB prompt's encoding takes ~210 MB, of
    which glibc keeps ~70 MB in its heap after the free otherwise. Small ones skip it (it walks the heap)."""
    if num_tokens >= LARGE_PROMPT_TOKENS:
        return_freed_memory()


def tokenize_prompt(
    tokenizer,
    prompt: str = "",
    messages: Sequence[prepare_pb2.ChatMessage] = (),
    prompt_token_ids: Sequence[int] = (),
    tools: Sequence[prepare_pb2.Tool] = (),
    template_kwargs: str = "",
) -> list[int]:
    """The prompt's token ids from exactly one of its three forms (ids are returned unchecked);
    ``tools`` and ``template_kwargs`` go to the chat template (see :func:`render_chat`).

    Raises:
        RequestError: ``INVALID_ARGUMENT`` when none or several forms are set, a chat message is
            bad, or the prompt tokenizes to nothing.
    """
    given = [name for name, value in (("prompt", prompt), ("messages", messages), ("prompt_token_ids", prompt_token_ids)) if value]
    if len(given) != 1:
        what = "none" if not given else " and ".join(given)
        raise invalid_argument(f"prompt: set exactly one of prompt (non-empty text), messages, prompt_token_ids; got {what}")
    if prompt_token_ids:
        return list(prompt_token_ids)
    if (tools or template_kwargs) and not messages:
        raise invalid_argument(f"{'tools' if tools else 'chat_template_kwargs'}: only with messages (they go to the chat template)")
    ids = render_chat(messages, tokenizer, tools, template_kwargs) if messages else list(tokenizer.encode(prompt, add_special_tokens=True))
    release_freed_memory(len(ids))
    if not ids:
        raise invalid_argument(f"{given[0]}: tokenizes to 0 tokens; give some text")
    return ids


def validate_generate_request(
    request: prepare_pb2.GenerateRequest, request_id: str, tokenizer, limits: ModelLimits
) -> GenerationRequest:
    """Validate ``request`` against the model and fill the defaults (see the module docstring).

    Args:
        request: the client's request.
        request_id: the id to serve it under (already resolved from the field / metadata).
        tokenizer: a Hugging Face tokenizer (``encode``, ``apply_chat_template``).
        limits: the served model's vocabulary and context sizes.

    Raises:
        RequestError: ``INVALID_ARGUMENT`` naming the first bad field and its allowed range.
    """
    check_generate_bounds(request)
    _check_text_can_fit(request, tokenizer, limits.max_model_len)
    ids = tokenize_prompt(tokenizer, request.prompt, request.messages, request.prompt_token_ids, request.tools,
                          request.chat_template_kwargs)
    max_tokens = _max_tokens(request, len(ids), limits.max_model_len)
    _check_token_ids("prompt_token_ids", ids, limits.vocab_size)
    sampling = _sampling(request, limits.vocab_size)
    if request.min_tokens > max_tokens:
        raise invalid_argument(f"min_tokens: {request.min_tokens} is more than max_tokens ({max_tokens}); use at most {max_tokens}")
    for i, text in enumerate(request.stop):
        if not text:
            raise invalid_argument(f"stop[{i}]: empty stop string; remove it")
    _check_token_ids("stop_token_ids", request.stop_token_ids, limits.vocab_size)
    stop = common_pb2.StopParams(
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        prompt_tokens=len(ids),
    )
    return GenerationRequest(request_id=request_id, prompt_token_ids=ids, max_tokens=max_tokens, sampling=sampling, stop=stop,
                             cache_salt=request.cache_salt, constraint=_constraint(request))


def _constraint(request: prepare_pb2.GenerateRequest) -> common_pb2.Constraint | None:
    """The request's constraint once it parses (`stageserve.structured_output`), or ``None``.

    The constraint decides where the completion ends, so ``ignore_eos`` and ``min_tokens``, which
    would sample past that end, are refused with it.
    """
    if not request.HasField("constraint"):
        return None
    for field, value in (("ignore_eos", request.ignore_eos), ("min_tokens", request.min_tokens)):
        if value:
            raise invalid_argument(f"{field}: cannot be combined with a constraint (the constraint decides where the completion ends); leave it unset")
    try:
        constraint_grammar(request.constraint)
    except ConstraintError as exc:
        raise invalid_argument(str(exc)) from None
    return request.constraint


@functools.lru_cache(maxsize=4)
def _max_token_chars(tokenizer) -> int:
    """Characters the longest vocabulary entry spells: no token covers more of a prompt's text."""
    return max(len(token) for token in tokenizer.get_vocab())


def _check_text_can_fit(request: prepare_pb2.GenerateRequest, tokenizer, max_model_len: int) -> None:
    """Refuse text that cannot fit the context before tokenizing it: tokenizing megabytes costs
    seconds of CPU and memory that a request refused anyway should not take."""
    chars = len(request.prompt) + sum(len(m.content) for m in request.messages)
    limit = max_model_len * _max_token_chars(tokenizer)
    if chars > limit:
        field = "prompt" if request.prompt else "messages"
        raise invalid_argument(
            f"{field}: {chars} characters cannot fit in the model's context of {max_model_len} tokens"
            f" (at most {limit} characters); shorten it"
        )


def _check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    for i, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise invalid_argument(f"{field}[{i}]: token id {token_id} is outside the vocabulary [0, {vocab_size})")


def _sampling(request: prepare_pb2.GenerateRequest, vocab_size: int) -> common_pb2.SamplingParams:
    """The request's sampling parameters with the defaults filled, checked against `stageserve.sampling_rules`."""
    sampling = common_pb2.SamplingParams(
        temperature=request.temperature if request.HasField("temperature") else 1.0,
        top_p=request.top_p if request.HasField("top_p") else 1.0,
        top_k=request.top_k,
        min_p=request.min_p,
        repetition_penalty=request.repetition_penalty if request.HasField("repetition_penalty") else 1.0,
        seed=request.seed if request.HasField("seed") else secrets.randbits(63),
        logprobs=request.logprobs,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=request.logit_bias,
    )
    broken = first_violation(sampling, vocab_size)
    if broken is not None:
        rule, value = broken
        raise invalid_argument(f"{rule.field}: {value} is {rule.problem}")
    if (problem := logit_bias_problem(sampling, vocab_size)) is not None:
        raise invalid_argument(problem)
    return sampling


def validate_choices(request: prepare_pb2.GenerateRequest) -> int:
    """The number of completions ``request`` asks for (``n``, default 1).

    Raises:
        RequestError: ``INVALID_ARGUMENT`` when ``n`` is 0 or more than `MAX_CHOICES`.
    """
    if not request.HasField("n"):
        return 1
    if request.n == 0:
        raise invalid_argument(f"n: must be at least 1 (at most {MAX_CHOICES}); leave it unset for 1")
    return at_most("n", request.n, MAX_CHOICES)


def _max_tokens(request: prepare_pb2.GenerateRequest, prompt_tokens: int, max_model_len: int) -> int:
    remaining = max_model_len - prompt_tokens
    if remaining < 1:
        raise invalid_argument(
            f"prompt: {prompt_tokens} tokens leave no room in the model's context of {max_model_len} tokens;"
            f" use at most {max_model_len - 1} prompt tokens"
        )
    if not request.HasField("max_tokens"):
        return min(DEFAULT_MAX_TOKENS, remaining)
    if request.max_tokens == 0:
        raise invalid_argument(f"max_tokens: must be at least 1 (at most {remaining} for this prompt); leave it unset for the default")
    if request.max_tokens > remaining:
        raise invalid_argument(
            f"max_tokens: prompt ({prompt_tokens} tokens) + max_tokens ({request.max_tokens}) = {prompt_tokens + request.max_tokens}"
            f" exceeds the model's context of {max_model_len} tokens; use max_tokens <= {remaining}"
        )
    return request.max_tokens
