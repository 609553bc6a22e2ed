"""The documented bounds of the public API's inputs, stated once for gRPC and the OpenAI HTTP API.

Both APIs map onto one ``GenerateRequest`` (and ``TokenizeRequest``), so the bounds are checked
here, on that message, by :func:`check_generate_bounds` and :func:`check_tokenize_bounds`: size
checks only (``len`` of fields), run before any tokenization, chat template or per-item work,
so an oversized request costs microseconds. Each refusal is ``INVALID_ARGUMENT`` naming the
field, its size and the limit; what is too large for the transport itself is refused by it
before decoding: gRPC's ``max_receive_message_length`` and the HTTP body limit are both
`MAX_REQUEST_BYTES` (``RESOURCE_EXHAUSTED`` / HTTP 413).

=========================  ==========================================  ==========================
bound                      applies to                                  limit
=========================  ==========================================  ==========================
request size               the encoded message / HTTP body             `MAX_REQUEST_BYTES`
prompt characters          ``prompt``, messages' texts, tools' texts   `MAX_PROMPT_CHARS`
chat messages              ``messages``                                `MAX_MESSAGES`
tools                      ``tools``                                   `MAX_TOOLS`
template variables         ``chat_template_kwargs`` (characters)       `MAX_TEMPLATE_KWARGS_CHARS`
prompt token ids           ``prompt_token_ids``                        `MAX_PROMPT_TOKEN_IDS`
stop strings               ``stop`` (count, characters of each)        `MAX_STOP_STRINGS`, `MAX_STOP_STRING_CHARS`
stop token ids             ``stop_token_ids``                          `MAX_STOP_TOKEN_IDS`
logprobs                   ``logprobs`` (top-n per token)              ``sampling_rules.MAX_LOGPROBS``
logit bias entries         ``logit_bias``                              ``sampling_rules.MAX_LOGIT_BIAS``
choices                    ``n``                                       `MAX_CHOICES`
request id, user, salt     characters                                  `MAX_REQUEST_ID_CHARS`, ...
=========================  ==========================================  ==========================

The model adds its own, checked in ``validation.py`` once its limits are known: the prompt must fit
the context (text longer than the context times the longest token is refused before tokenizing),
``prompt + max_tokens`` at most the context, token ids inside the vocabulary.
"""

from __future__ import annotations

from stageserve.prepare.errors import invalid_argument
from stageserve.sampling_rules import MAX_LOGIT_BIAS, MAX_LOGPROBS
from stageserve.v1 import prepare_pb2

MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""Bytes of one public request: a gRPC message (``max_receive_message_length``) or an HTTP body."""
MAX_PROMPT_CHARS = 1_048_576
"""Characters of a prompt: ``prompt`` plus the ``content`` of every chat message."""
MAX_MESSAGES = 1024
"""Chat messages of one request."""
MAX_TOOLS = 128
"""Tools of one request."""
MAX_TEMPLATE_KWARGS_CHARS = 65536
"""Characters of ``chat_template_kwargs`` (a JSON object)."""
MAX_PROMPT_TOKEN_IDS = 1_048_576
"""Entries of ``prompt_token_ids`` (the model's context bounds them further)."""
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 256
MAX_CHOICES = 16
MAX_USER_CHARS = 256
MAX_EMBEDDING_INPUTS = 2048
"""Inputs of one embeddings request (OpenAI's limit); each is one scheduler request."""


def check_generate_bounds(request: prepare_pb2.GenerateRequest) -> None:
    """Refuse ``request`` if any field is larger than its bound (see the module docstring).

    Raises:
        RequestError: ``INVALID_ARGUMENT`` naming the first field over its bound and the bound.
    """
    _check_prompt_text(request.prompt, request.messages, request.tools)
    at_most("tools", len(request.tools), MAX_TOOLS, "tools")
    at_most("chat_template_kwargs", len(request.chat_template_kwargs), MAX_TEMPLATE_KWARGS_CHARS, "characters")
    at_most("prompt_token_ids", len(request.prompt_token_ids), MAX_PROMPT_TOKEN_IDS, "entries")
    at_most("stop", len(request.stop), MAX_STOP_STRINGS, "strings")
    for i, text in enumerate(request.stop):
        at_most(f"stop[{i}]", len(text), MAX_STOP_STRING_CHARS, "characters")
    at_most("stop_token_ids", len(request.stop_token_ids), MAX_STOP_TOKEN_IDS, "entries")
    at_most("logprobs", request.logprobs, MAX_LOGPROBS)
    at_most("logit_bias", len(request.logit_bias), MAX_LOGIT_BIAS, "entries")
    at_most("n", request.n, MAX_CHOICES)
    at_most("request_id", len(request.request_id), MAX_REQUEST_ID_CHARS, "characters")
    at_most("user", len(request.user), MAX_USER_CHARS, "characters")
    at_most("cache_salt", len(request.cache_salt), MAX_CACHE_SALT_CHARS, "characters")


def check_tokenize_bounds(request: prepare_pb2.TokenizeRequest) -> None:
    """Refuse a ``Tokenize`` whose prompt is larger than its bound.

    Raises:
        RequestError: ``INVALID_ARGUMENT`` naming the field and the bound.
    """
    _check_prompt_text(request.prompt, request.messages)


def at_most(field: str, value: int, limit: int, unit: str = "") -> int:
    """``value`` if it is at most ``limit``.

    Raises:
        RequestError: ``INVALID_ARGUMENT`` ``"<field>: <value> <unit> is more than the maximum of <limit>"``.
    """
    if value > limit:
        raise invalid_argument(f"{field}: {value}{' ' + unit if unit else ''} is more than the maximum of {limit}")
    return value


def _check_prompt_text(prompt: str, messages, tools=()) -> None:
    at_most("messages", len(messages), MAX_MESSAGES, "messages")
    chars = len(prompt) + sum(_message_chars(m) for m in messages) + sum(
        len(t.name) + len(t.description) + len(t.parameters) for t in tools)
    at_most("prompt" if prompt else "messages", chars, MAX_PROMPT_CHARS, "characters")


def _message_chars(message: prepare_pb2.ChatMessage) -> int:
    """Characters of one chat message's texts (its tool calls' included)."""
    return (len(message.content) + len(message.role) + len(message.name) + len(message.tool_call_id)
            + sum(len(c.id) + len(c.name) + len(c.arguments) for c in message.tool_calls))
