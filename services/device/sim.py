"""The simulated device (``--backend sim``): a step takes a set time on a timeline and no compute.

It exists to measure the pipeline's own overhead apart from the model. Like an accelerator, it
takes a step's time off the host CPU: while a step "runs" nothing computes, so whatever the host
spends per step (prepare's scheduling, gRPC, the executor, reclaim's detokenization) shows as the
gap between the step period and the simulated step time. Everything above the backend is the real
code: plans are decoded and checked, the sequence table admits them, the `StepExecutor` hands out
step tickets and output slots, the completion thread waits, reclaim acks each slot.

- `SimBackend`: ``launch`` calls the step's ``run`` at once (it only writes the slot's host buffer)
  and returns a completion that is done when the simulated device finishes the step. Steps queue
  on one timeline in submission order: a step starts at its launch or when the previous step ends,
  whichever is later, and takes the seconds its ``run`` returned. Waiting is a ``time.sleep`` until
  that deadline, so the CPU stays idle.
- `SimStepRunner`: a step takes ``step_s + token_s * tokens`` (tokens: prefill and decode tokens of
  the step). The sampled id of a row depends only on the position it is sampled for (`sim_token_id`),
  so a request's output is the same in any batch; it is never an EOS id, so requests end by
  ``max_tokens`` (or a stop string).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from stageserve.device.backends import Backend, Completion
from stageserve.device.step_ticket import SlotBuffers, StepResult
from stageserve.device.step_plan import AdmittedStep

# Sampled ids start here, past the special and single-byte tokens, so the text decodes to words.
_FIRST_TOKEN = 1000
# Log-probability reported for the alternatives of a sampled id (the sim is certain of its choice).
_ALTERNATIVE_LOGPROB = -100.0


def sim_token_id(position: int, vocab_size: int, eos_token_ids: Collection[int]) -> int:
    """The id the simulated device samples for ``position`` (0-based index of the sampled token).

    A fixed hash of the position into ``[min(1000, vocab_size // 2), vocab_size)``, stepping past
    EOS ids, so outputs are reproducible and never end a request early.
    """
    first = min(_FIRST_TOKEN, vocab_size // 2)
    token = first + (position * 7919) % (vocab_size - first)
    while token in eos_token_ids:
        token = first + (token + 1 - first) % (vocab_size - first)
    return token


class SimBackend(Backend):
    """A device whose steps take the time their runner says, on one timeline, without computing.

    ``launch(run)`` expects ``run`` to return the step's device time in seconds (`SimStepRunner.run`
    does). The host buffers are plain tensors; ``device`` is the CPU (where the sequence table lives).
    """

    name = "sim"

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self._lock = threading.Lock()
        self._busy_until = 0.0  # time.monotonic() at which the last launched step ends

    def launch(self, run: Callable[[], float], rows: int = 0) -> Completion:
        seconds = run()
        with self._lock:
            self._busy_until = max(time.monotonic(), self._busy_until) + seconds
            return DeadlineCompletion(self._busy_until)

    def synchronize(self) -> None:
        DeadlineCompletion(self._busy_until).wait(None)


class DeadlineCompletion:
    """A completion that is done at ``deadline`` (``time.monotonic()`` seconds); waiting sleeps."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def wait(self, timeout: float | None) -> bool:
        remaining = self.deadline - time.monotonic()
        if timeout is not None and remaining > timeout:
            time.sleep(max(0.0, timeout))
            return False
        if remaining > 0:
            time.sleep(remaining)
        return True


@dataclass(frozen=True)
class SimStagedStep:
    """A simulated step's inputs: the sampled ids (one per sampling row, in output order) and its device time."""

    token_ids: torch.Tensor  # [S] int64
    top_logprobs: int  # alternatives asked for, at most over the rows
    seconds: float


class SimStepRunner:
    """The `StepRunner` of the simulated device (see the module docstring).

    Args:
        step_s: device time of every step, seconds (``--sim-step-ms`` / 1000).
        token_s: additional device time per token the step carries, seconds (``--sim-token-us`` / 1e6).
        vocab_size, eos_token_ids: the served model's, so the ids decode with its tokenizer.
    """

    def __init__(self, step_s: float, token_s: float, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        if step_s < 0 or token_s < 0:
            raise ValueError(f"simulated step time ({step_s} s) and per-token time ({token_s} s) must not be negative")
        self.step_s, self.token_s = step_s, token_s
        self._vocab_size, self._eos = vocab_size, frozenset(eos_token_ids)

    def stage(self, admitted: AdmittedStep) -> SimStagedStep:
        """Choose the step's sampled ids (by position) and its device time."""
        step = admitted.step
        positions = [p + n for p, n, s in zip(step.start_pos, step.num_tokens, step.sample) if s]
        ids = [sim_token_id(p, self._vocab_size, self._eos) for p in positions]
        top = max(admitted.sampled_top_logprobs, default=0)
        return SimStagedStep(torch.tensor(ids, dtype=torch.int64), top, self.step_s + self.token_s * len(step.token_ids))

    def run(self, staged: SimStagedStep, out: SlotBuffers) -> float:
        """Write the sampled ids (and certain logprobs) into the slot; return the step's device time in seconds."""
        count = staged.token_ids.shape[0]
        out.token_ids[:count].copy_(staged.token_ids)
        if staged.top_logprobs:
            top = staged.top_logprobs
            out.logprobs[:count].zero_()
            offsets = torch.arange(top, dtype=torch.int64)
            out.top_token_ids[:count, :top].copy_((staged.token_ids[:, None] + offsets) % self._vocab_size)
            out.top_logprobs[:count, :top].fill_(_ALTERNATIVE_LOGPROB)
            out.top_logprobs[:count, 0] = 0.0
        return staged.seconds

    def observe(self, staged: SimStagedStep, result: StepResult | None) -> dict[int, str]:
        """Nothing to learn: the simulated device serves no constraints (their rows sample as unconstrained)."""
        return {}
