"""The sampling rules both prepare and the device enforce, stated once.

prepare checks a client's request against them (and refuses it with ``INVALID_ARGUMENT``); the
device checks every ``SamplingParams`` of a plan against them again (and refuses the plan), since
the pipeline protocol is a trust boundary of its own. Each service words its message in its own
way from the same `FieldRange`. Also here: which rows are greedy, and how a uint64 seed is
stored in an int64 tensor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from stageserve.v1 import common_pb2

MAX_LOGPROBS = 20
"""Most top-n logprobs one row may ask for (``SamplingParams.logprobs``)."""

MAX_LOGIT_BIAS = 1024
"""Most ``logit_bias`` entries one request may carry."""

GREEDY_TEMPERATURE_EPS = 1e-5
"""Temperatures below this are greedy: dividing by them would overflow float32 (vLLM's _SAMPLING_EPS)."""


@dataclass(frozen=True)
class FieldRange:
    """The allowed values of one ``SamplingParams`` field.

    Attributes:
        field: the field's name (``top_p``).
        low: the lower bound; ``low_open``: whether ``low`` itself is excluded.
        high: the upper bound (included); ``math.inf`` for none, the value must then be finite.
        meaning: what the field's neutral value means (``"1 = off"``), ``""`` for nothing to say.
        high_name: what the upper bound is, for a field only that bound can break (an unsigned
            integer): ``"the maximum of 20"``; ``""`` otherwise.
    """

    field: str
    low: float
    low_open: bool
    high: float
    meaning: str = ""
    high_name: str = ""

    def allows(self, value: float) -> bool:
        """Whether ``value`` is allowed (NaN never is)."""
        above_low = value > self.low if self.low_open else value >= self.low
        return above_low and (value <= self.high if math.isfinite(self.high) else value < math.inf)

    @property
    def interval(self) -> str:
        """The allowed values as an interval: ``(0, 1]``, ``[0, 20]``, or ``>= 0`` without an upper bound."""
        if not math.isfinite(self.high):
            return f"{'>' if self.low_open else '>='} {number_text(self.low)}"
        return f"{'(' if self.low_open else '['}{number_text(self.low)}, {number_text(self.high)}]"

    @property
    def requirement(self) -> str:
        """What a value must be, to follow "must be": ``in (0, 1] (1 = off)``, ``a finite number >= 0 (0 = greedy)``."""
        text = f"in {self.interval}" if math.isfinite(self.high) else f"a finite number {self.interval}"
        return f"{text} ({self.meaning})" if self.meaning else text

    @property
    def problem(self) -> str:
        """What is wrong with a refused value, to follow "is": ``outside (0, 1]``, ``more than the maximum of 20``."""
        if self.high_name:
            return f"more than {self.high_name}"
        if not math.isfinite(self.high):
            return f"not {self.requirement}"
        return f"outside {self.interval} ({self.meaning})" if self.meaning else f"outside {self.interval}"


LOGIT_BIAS_RANGE = FieldRange("logit_bias", -100.0, False, 100.0)
"""The allowed bias of one ``logit_bias`` entry (OpenAI's range)."""


def number_text(value: float) -> str:
    """``value`` as messages write it: an integer in full, a float in ``%g`` (``0``, ``1.5``, ``nan``)."""
    return str(value) if isinstance(value, int) else f"{value:g}"


@functools.lru_cache(maxsize=8)
def sampling_ranges(vocab_size: int | None) -> tuple[FieldRange, ...]:
    """The ranges of the ``SamplingParams`` fields, in the order they are checked.

    ``vocab_size`` (tokens) bounds ``top_k``; ``None`` leaves it unbounded.
    """
    top_k_high = math.inf if vocab_size is None else vocab_size
    top_k_name = "" if vocab_size is None else f"the vocabulary ({vocab_size} tokens)"
    return (
        FieldRange("temperature", 0.0, False, math.inf, "0 = greedy"),
        FieldRange("top_p", 0.0, True, 1.0, "1 = off"),
        FieldRange("top_k", 0, False, top_k_high, "0 = off", top_k_name),
        FieldRange("min_p", 0.0, False, 1.0, "0 = off"),
        FieldRange("repetition_penalty", 0.0, True, math.inf, "1 = off"),
        FieldRange("logprobs", 0, False, MAX_LOGPROBS, high_name=f"the maximum of {MAX_LOGPROBS}"),
        FieldRange("presence_penalty", -2.0, False, 2.0, "0 = off"),
        FieldRange("frequency_penalty", -2.0, False, 2.0, "0 = off"),
    )


def first_violation(params: common_pb2.SamplingParams, vocab_size: int | None) -> tuple[FieldRange, float] | None:
    """The first field of ``params`` outside its range, with its value; ``None`` when all are allowed."""
    for rule in sampling_ranges(vocab_size):
        value = getattr(params, rule.field)
        if not rule.allows(value):
            return rule, value
    return None


def logit_bias_problem(params: common_pb2.SamplingParams, vocab_size: int | None) -> str | None:
    """What is wrong with ``params.logit_bias`` (a sentence naming the entry), ``None`` when nothing is:
    at most `MAX_LOGIT_BIAS` entries, token ids in ``[0, vocab_size)``, biases in `LOGIT_BIAS_RANGE`."""
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        return f"logit_bias: {len(params.logit_bias)} entries is more than the maximum of {MAX_LOGIT_BIAS}"
    for token_id, bias in sorted(params.logit_bias.items()):
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            return f"logit_bias: token id {token_id} is outside the vocabulary [0, {vocab_size})"
        if not LOGIT_BIAS_RANGE.allows(bias):
            return f"logit_bias[{token_id}]: {number_text(bias)} is {LOGIT_BIAS_RANGE.problem}"
    return None


def is_greedy(temperature: float, top_k: int) -> bool:
    """Whether a row takes the argmax: a temperature below `GREEDY_TEMPERATURE_EPS`, or ``top_k == 1``
    (the same token, so the row skips sampling altogether)."""
    return temperature < GREEDY_TEMPERATURE_EPS or top_k == 1


def seed_as_int64(seed: int) -> int:
    """A uint64 ``SamplingParams.seed`` as the int64 with the same bits (torch has no uint64 math)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed
