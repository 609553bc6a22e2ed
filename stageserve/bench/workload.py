"""What a benchmark sends: prompts (the built-in set or a JSONL file) shaped to input/output lengths.

A prompt file has one JSON object per line with exactly one of ``"messages"`` (chat, rendered with
the model's template), ``"prompt"`` (raw text) or ``"prompt_token_ids"``. Request ``i`` uses prompt
``order[i % len(prompts)]`` where ``order`` is a seeded shuffle, and its lengths come from the same
seeded generator, so two runs with the same flags send the same requests in the same order.

Lengths: ``output_len`` is ``max_tokens`` with ``ignore_eos`` (fixed output), or, with
``spread`` > 0, drawn uniformly from ``[len * (1 - spread), len * (1 + spread)]``. ``input_len``
(optional) cuts or repeats the prompt's token ids to that many tokens (drawn the same way);
without it the prompt is sent as text and keeps its natural length.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from stageserve.v1 import common_pb2, prepare_pb2

BUILTIN_PROMPTS = "prompts.jsonl"


@dataclass(frozen=True)
class Shape:
    """Length shaping of a workload (tokens); see the module docstring.

    Attributes:
        output_len: ``max_tokens`` of every request (before spread).
        input_len: prompt length in tokens; ``None`` keeps each prompt's natural length.
        spread: 0 for fixed lengths, else the relative half-width of the uniform draw, in [0, 1).
        ignore_eos: generate exactly ``max_tokens`` tokens (no early EOS).
        temperature: sampling temperature (0 = greedy).
        constraint: structured output of every request (``None``: free text); needs ``ignore_eos`` off.
    """

    output_len: int = 128
    input_len: int | None = None
    spread: float = 0.0
    ignore_eos: bool = True
    temperature: float = 0.0
    constraint: common_pb2.Constraint | None = None


def load_prompts(path: Path | None = None) -> list[dict]:
    """The prompt entries of ``path`` (JSONL), or of the built-in set when ``None``.

    Raises:
        ValueError: a line is not JSON or has not exactly one of messages/prompt/prompt_token_ids;
            the message names file and line.
    """
    if path is None:
        text = resources.files(__package__).joinpath(BUILTIN_PROMPTS).read_text(encoding="utf-8")
        name = f"built-in {BUILTIN_PROMPTS}"
    else:
        text, name = Path(path).read_text(encoding="utf-8"), str(path)
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} line {number}: not JSON ({exc})") from None
        if not isinstance(entry, dict) or sum(key in entry for key in ("messages", "prompt", "prompt_token_ids")) != 1:
            raise ValueError(f"{name} line {number}: give exactly one of \"messages\", \"prompt\", \"prompt_token_ids\"")
        entries.append(entry)
    if not entries:
        raise ValueError(f"{name}: no prompts")
    return entries


def base_request(entry: dict) -> prepare_pb2.GenerateRequest:
    """The ``GenerateRequest`` input fields of one prompt entry (no sampling fields)."""
    if "messages" in entry:
        return prepare_pb2.GenerateRequest(messages=[prepare_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in entry["messages"]])
    if "prompt" in entry:
        return prepare_pb2.GenerateRequest(prompt=entry["prompt"])
    return prepare_pb2.GenerateRequest(prompt_token_ids=entry["prompt_token_ids"])


class Workload:
    """The deterministic request sequence of one benchmark run.

    Args:
        prompts: entries from `load_prompts`.
        shape: lengths and sampling.
        seed: seeds the prompt order and the length draws.
        tokenize: token ids of a request's input (needed only with ``shape.input_len``); the
            gRPC load generator passes prepare's ``Tokenize`` RPC.
    """

    def __init__(
        self,
        prompts: list[dict],
        shape: Shape,
        seed: int = 0,
        tokenize: Callable[[prepare_pb2.GenerateRequest], list[int]] | None = None,
    ) -> None:
        if not 0.0 <= shape.spread < 1.0:
            raise ValueError(f"length spread must be in [0, 1), got {shape.spread}")
        if shape.input_len is not None and tokenize is None:
            raise ValueError("a fixed input length needs a tokenizer")
        if shape.constraint is not None and shape.ignore_eos:
            raise ValueError("a constraint decides where the output ends: it needs --no-ignore-eos")
        self.shape, self.seed = shape, seed
        self._prompts = [base_request(entry) for entry in prompts]
        self._order = list(range(len(prompts)))
        random.Random(seed).shuffle(self._order)
        self._tokenize = tokenize
        self._token_ids: dict[int, list[int]] = {}

    def request(self, index: int) -> prepare_pb2.GenerateRequest:
        """Request number ``index`` (0-based); the same for the same index, seed and shape."""
        shape = self.shape
        draw = random.Random(f"{self.seed}/{index}")  # per-index stream: independent of how many were drawn before
        prompt = self._order[index % len(self._order)]
        request = prepare_pb2.GenerateRequest(
            request_id=f"bench-{self.seed}-{index}", max_tokens=self._length(shape.output_len, draw),
            ignore_eos=shape.ignore_eos, temperature=shape.temperature, seed=index, constraint=shape.constraint,
        )
        if shape.input_len is None:
            request.MergeFrom(self._prompts[prompt])
        else:
            request.prompt_token_ids.extend(self._input_ids(prompt, self._length(shape.input_len, draw)))
        return request

    def _length(self, length: int, draw: random.Random) -> int:
        spread = self.shape.spread
        if not spread:
            return length
        return max(1, round(draw.uniform(length * (1 - spread), length * (1 + spread))))

    def _input_ids(self, prompt: int, length: int) -> list[int]:
        if prompt not in self._token_ids:
            assert self._tokenize is not None
            self._token_ids[prompt] = self._tokenize(self._prompts[prompt])
        ids = self._token_ids[prompt]
        return (ids * (length // len(ids) + 1))[:length]
