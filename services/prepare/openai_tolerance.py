"""The OpenAI-compatible API's tolerance policy: what happens to a request field stageserve does
not implement (DESIGN.md, "Public API conventions"; the table of fields is ``docs/openai-api.md``).

- A field that cannot change the result the client asked for is **ignored**: the fields of
  `IGNORED_FIELDS` (bookkeeping such as ``metadata``, ``store``; hints such as
  ``service_tier``, ``prediction``), and any field this server does not know (as vLLM and
  llama.cpp's server do, so clients written for them run unmodified). Each is logged once per
  field name: at debug level for a listed field, at warning level for an unknown one (a
  misspelt field then shows in the log).
- A field whose value would make the result differ from what was asked is **refused** with 400
  naming it and saying what to change: the fields of `REFUSED_FIELDS`, unless their value is the
  neutral one (``use_beam_search: false``, ``modalities: ["text"]``), which is then ignored.

Request models derive from :class:`TolerantModel`, which applies both rules before pydantic
validates the declared fields (a ``null`` field counts as not sent, as in OpenAI's API).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from stageserve.prepare.errors import invalid_argument

log = logging.getLogger(__name__)

IGNORED_FIELDS: dict[str, str] = {
    "metadata": "the caller's tags, for OpenAI's dashboard",
    "store": "OpenAI keeps the completion for its dashboard; stageserve keeps nothing (stateless)",
    "service_tier": "OpenAI's billing tier; one tier here",
    "prediction": "predicted output, a latency hint: the completion is the same with or without it",
    "reasoning_effort": "OpenAI's reasoning models only; a model here reasons as its chat template says",
    "verbosity": "OpenAI's reasoning models only",
    "safety_identifier": "OpenAI's abuse tracking",
    "prompt_cache_key": "OpenAI's cache routing hint; the prefix cache here needs none",
    "stream_options.include_obfuscation": "OpenAI's padding of streamed chunks",
    "truncation": "Responses: the whole input must fit the context, as with 'disabled'",
    "reasoning": "Responses: OpenAI's reasoning options; a model here reasons as its chat template says",
    "include": "Responses: extra output data to return (encrypted reasoning, ...); none is kept here",
}
"""Fields ignored because they cannot change the result, with why (the docs table is made from these)."""


def _neutral(*values: object) -> Callable[[object], bool]:
    return lambda value: value in values


REFUSED_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "best_of": (_neutral(1), "only 1 is supported; use n for several completions"),
    "use_beam_search": (_neutral(False), "beam search is not supported; leave it unset"),
    "prompt_logprobs": (_neutral(0), "prompt logprobs are not supported; leave it unset"),
    "echo": (_neutral(False), "true is not supported; leave it unset"),
    "suffix": (_neutral(""), "is not supported (no fill-in-the-middle); leave it unset"),
    "modalities": (_neutral(["text"]), "only text output is served; send [\"text\"] or leave it unset"),
    "audio": (lambda _: False, "audio output is not served; leave it unset"),
    "web_search_options": (lambda _: False, "web search is not served; leave it unset"),
    "functions": (lambda _: False, "the legacy functions field is not served; send tools instead"),
    "function_call": (lambda _: False, "the legacy function_call field is not served; send tool_choice instead"),
    "guided_json": (lambda _: False, "vLLM's old guided_* fields are not served; send structured_outputs or response_format"),
    "guided_regex": (lambda _: False, "vLLM's old guided_* fields are not served; send structured_outputs"),
    "guided_choice": (lambda _: False, "vLLM's old guided_* fields are not served; send structured_outputs"),
    "guided_grammar": (lambda _: False, "vLLM's old guided_* fields are not served; send structured_outputs"),
    "previous_response_id": (lambda _: False, "this server is stateless and keeps no responses; send the whole conversation in input"),
    "conversation": (lambda _: False, "this server is stateless and keeps no conversations; send the whole conversation in input"),
    "skip_special_tokens": (_neutral(True), "vLLM's: special tokens are always skipped here; send true or leave it unset"),
    "spaces_between_special_tokens": (_neutral(True), "vLLM's: special tokens are always skipped here; send true or leave it unset"),
    "add_generation_prompt": (_neutral(True), "vLLM's: a chat always ends with the assistant's generation prompt here; send true"
                                              " or leave it unset"),
    "continue_final_message": (_neutral(False), "vLLM's: continuing the last message is not served; leave it unset"),
    "background": (_neutral(False), "background responses are not served (nothing is stored); leave it unset"),
}
"""Fields refused with 400 unless their value is neutral: ``name -> (is the value neutral, what to change)``."""

MAX_LOGGED_NAMES = 1024
"""Field names remembered as logged, at most: clients choose the names, so the set is bounded (names
past it are not logged)."""
_logged: set[str] = set()
_logged_lock = threading.Lock()


def log_ignored(name: str) -> None:
    """Log once per process that field ``name`` (a dotted path) was ignored, with the reason."""
    with _logged_lock:
        if name in _logged or len(_logged) >= MAX_LOGGED_NAMES:
            return
        _logged.add(name)
    leaf = name.rsplit(".", 1)[-1]
    reason = IGNORED_FIELDS.get(name) or IGNORED_FIELDS.get(leaf)
    if reason is not None or leaf in REFUSED_FIELDS:
        log.debug("request field %r ignored (logged once): %s", name, reason or "its neutral value")
    else:
        log.warning("request field %r is not known to this server and was ignored (logged once)", name)


class TolerantModel(BaseModel):
    """A request body (or part of one) under the tolerance policy (see the module docstring).

    Subclasses set ``where`` to the dotted prefix of their fields in log lines and messages
    (``"stream_options"``); a body's top level has ``""``.
    """

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    where: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _tolerate(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        prefix = f"{cls.where}." if cls.where else ""
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        kept = {}
        for key, value in data.items():
            if value is None:
                continue
            if key in known:
                kept[key] = value
                continue
            if key in REFUSED_FIELDS:
                neutral, what = REFUSED_FIELDS[key]
                if not neutral(value):
                    raise invalid_argument(f"{prefix}{key}: {what}")
            log_ignored(f"{prefix}{key}")
        return kept
