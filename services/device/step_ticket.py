"""A submitted step's handle and outputs: `StepTicket` (the wait contract), `StepResult`, and the slot-local
host buffers (`SlotBuffers`) the step's device-to-host copy writes. `StepExecutor` (``executor.py``)
hands tickets out at submit and resolves them in order on its completion thread.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import accumulate

import torch

from stageserve.device.backends import Completion
from stageserve.device.step_plan import AdmittedStep
from stageserve.tracing import Tracer

log = logging.getLogger(__name__)


class TicketTimeout(TimeoutError):
    """``StepTicket.wait`` timed out; the step may still complete, so waiting again is allowed."""


@dataclass(frozen=True)
class SlotBuffers:
    """Host buffers of one output slot (pinned on accelerators), written by the step's device-to-host copy.

    Attributes:
        token_ids: ``[max_rows]`` int64, sampled id of sampling row ``r`` at ``[r]`` (speculative
            decoding: of sampling entry ``e``, a decode row having ``1 + k`` consecutive entries).
        logprobs: ``[max_rows]`` float32, log-probability of the sampled id.
        top_token_ids: ``[max_rows, max_top_logprobs]`` int64, most likely first.
        top_logprobs: ``[max_rows, max_top_logprobs]`` float32.
        num_tokens, num_drafted: ``[max_rows]`` int64, speculative decoding only: per sampling row,
            tokens it emits (its first entries) and drafts the proposer made for it.
        embeddings: ``[max_rows, hidden]`` float32, the step's embeddings in sampling-row order
            (`AdmittedStep.pooling`); ``None`` on a device that does not embed.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_token_ids: torch.Tensor
    top_logprobs: torch.Tensor
    num_tokens: torch.Tensor
    num_drafted: torch.Tensor
    embeddings: torch.Tensor | None = None


@dataclass(frozen=True)
class SampledLogprob:
    """Log-probability (natural log) of one sampled token and the top-n alternatives at that position."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class StepResult:
    """What one completed step produced, in the ticket's sampling-row order.

    Attributes:
        token_ids: one sampled id per sampling row (speculative decoding: ``num_tokens[r]`` per row).
        logprobs: one entry per token id when any row asked for logprobs (``None`` for rows
            that did not), else ``None``.
        completed_unix_ns: wall-clock time the completion was observed.
        num_tokens, num_drafted: per sampling row, tokens emitted and drafts proposed, on a
            speculating device; else ``None``.
        row_errors: sampling row -> why that row's request fails (the runner's `StepRunner.observe`).
        embeddings: sampling row -> the embedding it outputs (``hidden`` floats), for embedding
            sequences whose prompt ended in the step.
    """

    token_ids: list[int]
    logprobs: list[SampledLogprob | None] | None
    completed_unix_ns: int
    num_tokens: list[int] | None = None
    num_drafted: list[int] | None = None
    row_errors: dict[int, str] = field(default_factory=dict)
    embeddings: dict[int, list[float]] = field(default_factory=dict)

    def first_tokens(self) -> list[int]:
        """Each sampling row's first token (speculative decoding: the one after its pending token)."""
        if self.num_tokens is None:
            return self.token_ids
        return [self.token_ids[start] for start in accumulate([0, *self.num_tokens[:-1]])]


class StepTicket:
    """Handle to one submitted step: the only way to learn its outputs or its failure.

    Wait contract (`wait`): idempotent and thread-safe. The first call that observes the step's
    completion reads the outputs from the step's slot buffers, frees the step's transient uploads
    and stores the `StepResult`, or stores the step's exception and frees the uploads too. Every
    later or concurrent call returns that same result object or raises that same exception object.
    The uploads are freed exactly once (`uploads_freed` counts it) whether the step succeeded or failed.

    Attributes:
        ticket_id: unique per executor, increasing in submission order (starts at 1).
        step_id: the step's ``step_id``.
        admitted: the step the ticket was submitted for.
        slot: index of the output slot the step writes.
        submitted_unix_ns: wall-clock submit time.
        uploads_freed: 0 until resolution, then 1.

    ``tracer`` records the ``device.copy_out`` span of the resolution (outputs out of the slot; with
    speculative decoding its args ``draft_tokens`` and ``accepted_tokens`` sum the step's rows).
    """

    def __init__(self, ticket_id: int, admitted: AdmittedStep, slot: int, buffers: SlotBuffers, tracer: Tracer) -> None:
        self.ticket_id = ticket_id
        self.step_id = admitted.step.step_id
        self.admitted = admitted
        self.slot = slot
        self.submitted_unix_ns = time.time_ns()
        self.uploads_freed = 0
        self._buffers = buffers
        self._tracer = tracer
        self._completion: Completion | None = None
        self._uploads: object = None
        self._observe: Callable[[object, StepResult | None], dict[int, str]] | None = None
        self._resolve_lock = threading.Lock()
        self._resolved = threading.Event()
        self._result: StepResult | None = None
        self._error: BaseException | None = None

    def _bind(self, completion: Completion, uploads: object, observe: Callable[[object, list[int] | None], dict[int, str]]) -> None:
        self._completion, self._uploads, self._observe = completion, uploads, observe

    def done(self) -> bool:
        """True once the ticket is resolved (a `wait` has observed success or failure)."""
        return self._resolved.is_set()

    def wait(self, timeout: float | None = None) -> StepResult:
        """Wait for the step; return its `StepResult`.

        Args:
            timeout: seconds to wait at most; ``None`` waits without limit.

        Raises:
            TicketTimeout: not completed within ``timeout`` (nothing is stored; wait again later).
            BaseException: the exception the step failed with, the same object for every waiter.
        """
        if not self._resolved.is_set():
            deadline = None if timeout is None else time.monotonic() + timeout
            if not self._resolve_lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                raise TicketTimeout(f"ticket {self.ticket_id} (step {self.step_id}) not completed within {timeout} s")
            try:
                if not self._resolved.is_set():
                    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                    self._resolve(remaining)
            finally:
                self._resolve_lock.release()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def _resolve(self, timeout: float | None) -> None:
        assert self._completion is not None, "ticket waited before it was launched"
        try:
            if not self._completion.wait(timeout):
                raise TicketTimeout(f"ticket {self.ticket_id} (step {self.step_id}) not completed within {timeout} s")
            with self._tracer.span("device.copy_out", step_id=self.step_id, ticket=self.ticket_id) as span:
                result = self._read_outputs()
                if result.num_drafted is not None and self._tracer.enabled:  # the trace analyzer's acceptance
                    span.set(draft_tokens=sum(result.num_drafted), accepted_tokens=len(result.token_ids) - len(result.num_tokens))
                if self._uploads is not None:
                    result = replace(result, row_errors=self._observe(self._uploads, result))
                self._result = result
        except TicketTimeout:
            raise
        except BaseException as exc:  # noqa: BLE001 - stored and re-raised to every waiter
            traceback.clear_frames(exc.__traceback__)  # their locals would keep the step's inputs alive
            self._error = exc
            self._observe_failure()
        self._uploads = None  # the step's device work is over: its inputs may go
        self.uploads_freed += 1
        self._resolved.set()

    def _observe_failure(self) -> None:
        """Tell the runner the step failed (so nothing waits for its tokens); a second failure is logged."""
        if self._uploads is None or self._result is not None:
            return
        try:
            self._observe(self._uploads, None)
        except Exception:  # noqa: BLE001 - the step has failed already
            log.exception("observing failed step %d", self.step_id)

    def _read_outputs(self) -> StepResult:
        step, buffers = self.admitted.step, self._buffers
        rows = len(step.sampled_seq_index)
        entries = [1 + k for k in step.sampled_num_drafts] if step.speculative else [1] * rows
        count = sum(entries)
        token_ids = buffers.token_ids[:count].tolist()
        # Entry e belongs to row owner[e]; a speculative row keeps its first num_tokens[r] entries.
        owner = [r for r, n in enumerate(entries) for _ in range(n)]
        num_tokens = num_drafted = None
        kept = range(count)
        if step.speculative:
            num_tokens, num_drafted = buffers.num_tokens[:rows].tolist(), buffers.num_drafted[:rows].tolist()
            starts = [0, *accumulate(entries)]
            kept = [e for r in range(rows) for e in range(starts[r], starts[r] + num_tokens[r])]
        logprobs = None
        top_n = self.admitted.sampled_top_logprobs
        if any(top_n):
            lp = buffers.logprobs[:count].tolist()
            top_ids = buffers.top_token_ids[:count].tolist()
            top_lp = buffers.top_logprobs[:count].tolist()
            logprobs = [
                SampledLogprob(token_ids[e], lp[e], top_ids[e][: top_n[owner[e]]], top_lp[e][: top_n[owner[e]]]) if top_n[owner[e]] else None
                for e in kept
            ]
        outputs = [pooling.output for pooling in self.admitted.pooling if pooling.output is not None]
        embeddings = dict(zip(outputs, buffers.embeddings[: len(outputs)].tolist())) if outputs else {}
        return StepResult([token_ids[e] for e in kept], logprobs, time.time_ns(), num_tokens, num_drafted, embeddings=embeddings)
