"""Reasoning output in the OpenAI-compatible API: a choice's ``<think>...</think>`` text apart from
its answer, as vLLM's ``--reasoning-parser`` gives it (``reasoning_content`` in chat completions).

Two parsers (``--reasoning-parser``), as vLLM names them:

- ``qwen3``: the model writes both tags (``<think>reasoning</think>answer``); text that does not
  start with ``<think>`` is the answer (a model told not to think, e.g. Qwen3 with
  ``chat_template_kwargs: {"enable_thinking": false}``, writes none); a ``<think>`` never closed
  is reasoning cut off.
- ``deepseek_r1``: the template opens ``<think>`` in the generation prompt, so the model writes only
  ``reasoning</think>answer``; a leading ``<think>`` is dropped too. Text with no ``</think>`` is
  all reasoning (cut off while thinking).

Streaming holds back only a tail that could still become a tag, so reasoning and answer deltas
never hold a piece of one. A structured-output constraint (``response_format``, a forced tool
call; not vLLM's ``structured_outputs``, the client's own grammar of the whole text) applies to
the answer only: :func:`constrain_after_reasoning` puts the reasoning before it
in the grammar (free text up to ``</think>``; it cannot hold ``<`` right before ``</think>``).
"""

from __future__ import annotations

from dataclasses import dataclass

from stageserve.prepare.errors import invalid_argument
from stageserve.prepare.text_tags import partial_tag_length
from stageserve.v1 import common_pb2

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ReasoningReader:
    """Splits one choice's text into reasoning and answer.

    :meth:`feed` takes each text delta and returns ``(reasoning, answer)`` to stream now;
    :meth:`finish` flushes what was held back. ``opened``: the prompt already opened ``<think>``
    (``deepseek_r1``); else reasoning starts only at a ``<think>`` the model writes (``qwen3``).
    """

    opened: bool = False
    pending: str = ""
    state: str = "start"  # start (no text seen that decides), thinking, closed (just after </think>), answering

    def feed(self, text: str) -> tuple[str, str]:
        """One text delta in; ``(reasoning, answer)`` to stream now out."""
        self.pending += text
        reasoning, answer = [], []
        while self.pending:
            if self.state == "answering":
                answer.append(self.pending)
                self.pending = ""
            elif self.state == "closed":  # templates put newlines after </think>: not part of the answer
                self.pending = self.pending.lstrip("\n")
                self.state = "answering" if self.pending else "closed"
            elif self.state == "start":
                stripped = self.pending.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self.pending, self.state = stripped[len(THINK_OPEN):], "thinking"
                elif THINK_OPEN.startswith(stripped):
                    break  # could still become <think>
                else:
                    self.state = "thinking" if self.opened else "answering"
            else:  # thinking
                end = self.pending.find(THINK_CLOSE)
                if end >= 0:
                    reasoning.append(self.pending[:end])
                    self.pending, self.state = self.pending[end + len(THINK_CLOSE):], "closed"
                    continue
                keep = partial_tag_length(self.pending, THINK_CLOSE)
                reasoning.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """The choice ended: ``(reasoning, answer)`` of what was held back."""
        rest, self.pending = self.pending, ""
        thinking = self.state == "thinking" or (self.state == "start" and self.opened)
        return (rest, "") if thinking else ("", rest)


REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}
"""``--reasoning-parser`` choices: whether the template has already opened ``<think>``."""

# Any text without "</think>", then "</think>" and the newlines templates put after it.
_REASONING = r"([^<]|<[^/]|</[^t]|</t[^h]|</th[^i]|</thi[^n]|</thin[^k]|</think[^>])*</think>\n*"


def constrain_after_reasoning(constraint: common_pb2.Constraint, parser: str) -> common_pb2.Constraint:
    """``constraint`` with the reasoning before it, as an xgrammar EBNF ``grammar`` constraint: free
    reasoning up to ``</think>`` (``qwen3``: all of it optional, opened by ``<think>``), then the
    constrained answer.

    Raises:
        RequestError: ``INVALID_ARGUMENT``: the constraint does not parse, or the combined grammar
            is longer than ``MAX_CONSTRAINT_CHARS``.
    """
    # Here, not at the top: xgrammar imports torch, and the launcher reads REASONING_PARSERS (openai_flags).
    import xgrammar

    from stageserve.structured_output import MAX_CONSTRAINT_CHARS, ConstraintError, constraint_grammar

    try:
        answer = constraint_grammar(constraint)
    except ConstraintError as exc:
        raise invalid_argument(str(exc)) from None
    reasoning = _REASONING if REASONING_PARSERS[parser] else f"(<think>{_REASONING})?"
    text = str(xgrammar.Grammar.concat(xgrammar.Grammar.from_regex(reasoning), answer))
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise invalid_argument(f"response_format: its grammar after the reasoning is {len(text)} characters, more than the maximum"
                               f" of {MAX_CONSTRAINT_CHARS}; send a smaller schema")
    return common_pb2.Constraint(grammar=text)


def reasoning_reader(parser: str | None) -> ReasoningReader | None:
    """A new reader for one choice under ``parser`` (``None``: no reasoning parser, plain text)."""
    return None if parser is None else ReasoningReader(opened=REASONING_PARSERS[parser])
