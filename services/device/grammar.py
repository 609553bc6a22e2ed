"""Structured output on the device: compiled grammars, per-sequence matchers, and the bitmask of
each constrained sampling row, applied to its logits just before sampling.

Why here (see docs/pipeline-protocol.md, "Structured output"): row r's mask at step N+1 depends
on the token r sampled at step N, and the device submits step N+1 before step N's tokens reach
any host. So the matchers live where those tokens first reach the host: a step's ticket
resolution (`StepExecutor`'s completion thread, or ``submit`` in sync dispatch) hands them to
`GrammarTable.observe`, which advances each constrained row's matcher and fills its next bitmask
while the next step's forward pass runs. That next step needs the mask only at sampling:
`GrammarTable.mask_logits` waits (on the host) for just its constrained rows' previous tokens to
have been observed, then masks those rows' logits in place. A step without constrained rows
pays nothing; unconstrained rows are never touched.

Threads: `stage` (submitting thread) registers new constrained sequences, whose grammar compiles
at once on a worker thread (`CompiledGrammars`); `mask_logits` runs in the step's device work
(cpu: the compute thread; cuda/npu: the submitting thread, enqueueing); `observe` on the
resolving thread. A sequence's matcher is created by the worker, then only `observe` touches it,
and `mask_logits` reads a row's bitmask only after waiting for that row's previous `observe`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xgrammar

from stageserve.device.kernels import cpu_kernels
from stageserve.device.step_plan import StartedSequence, Step
from stageserve.structured_output import ConstraintError, constraint_grammar, readable_error
from stageserve.v1 import common_pb2

log = logging.getLogger(__name__)

COMPILE_CACHE_ENTRIES = 256
"""Compiled grammars kept (least recently used dropped first); a JSON schema's is ~70 KB."""
MASK_WAIT_S = 60.0
"""How long a step's sampling waits for a row's grammar (compile, previous token) before failing the step."""
_ALL_ALLOWED = -1  # an int32 bitmask word with every bit set


class CompiledGrammars:
    """Grammars compiled against the model's vocabulary on one worker thread, cached by constraint.

    Args:
        tokenizer_info: builds the ``xgrammar.TokenizerInfo`` (vocabulary and stop tokens); run once
            on the worker from construction on, while the model loads (`wait_ready`).
        max_entries: compiled grammars kept.
        on_compile: called with ``(cached, seconds)`` for each `get`: the compile's time on the
            worker, or the cache lookup's (the device's metrics).
    """

    def __init__(self, tokenizer_info: Callable[[], xgrammar.TokenizerInfo], max_entries: int = COMPILE_CACHE_ENTRIES,
                 on_compile: Callable[[bool, float], None] = lambda cached, seconds: None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-grammar")
        self._compiler = self._pool.submit(lambda: xgrammar.GrammarCompiler(tokenizer_info(), max_threads=1, cache_enabled=False))
        self._cache: OrderedDict[bytes, Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._max_entries = max_entries
        self._on_compile = on_compile
        self._lock = threading.Lock()

    def wait_ready(self) -> None:
        """Block until the vocabulary is read (start-up: the first constrained step must not wait for it)."""
        self._compiler.result()

    def get(self, constraint: common_pb2.Constraint) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of ``constraint``, compiling it on the worker if it is not cached.

        The future raises `ConstraintError` for a constraint xgrammar refuses (prepare has parsed
        it already, so only a bug or a different xgrammar version gets there).
        """
        start = time.perf_counter()
        key = constraint.SerializeToString(deterministic=True)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self._on_compile(True, time.perf_counter() - start)
                return future
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
            if len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
            return future

    def submit(self, fn: Callable[[], None]) -> Future[None]:
        """Run ``fn`` on the worker, after every compile queued before it (one worker, FIFO)."""
        return self._pool.submit(fn)

    def _compile(self, constraint: common_pb2.Constraint) -> xgrammar.CompiledGrammar:
        start = time.perf_counter()
        compiled = self._compiler.result().compile_grammar(constraint_grammar(constraint))
        seconds = time.perf_counter() - start
        log.info("compiled a %s constraint in %.1f ms", constraint.WhichOneof("kind"), seconds * 1e3)
        self._on_compile(False, seconds)
        return compiled


@dataclass(eq=False)
class SequenceGrammar:
    """One constrained sequence's grammar state (see the module docstring for who touches what).

    Attributes:
        generation: the sequence's generation (a new start at its index replaces this object).
        request_id: the request it serves (an abort of that id drops the state).
        ready: done once the matcher exists and ``bitmask`` holds its first mask (or it failed).
        matcher: advanced by one token per observed sampling row.
        bitmask: ``[ceil(V / 32)]`` int32, host: the tokens the matcher allows next.
        submitted: sampling rows staged (submitting thread).
        observed: sampling rows observed (resolving thread); row k's mask is ready once ``observed == k``.
        error: why the sequence fails; reported once, with the next row observed.
        error_reported: the error went out with a step's output.
    """

    generation: int
    request_id: str
    ready: Future[None]
    matcher: xgrammar.GrammarMatcher | None = None
    bitmask: torch.Tensor | None = None
    submitted: int = 0
    observed: int = 0
    error: str | None = None
    error_reported: bool = False


@dataclass(frozen=True)
class GrammarRows:
    """A step's constrained sampling rows, staged at submit time (the step's transient state).

    Attributes:
        rows: sampling-row index of each constrained row (row of the step's logits).
        states: their sequences' grammar states.
        observed_before: per row, the sampling rows of that sequence submitted before this one:
            its mask is ready once ``state.observed`` reaches it.
    """

    rows: list[int]
    states: list[SequenceGrammar]
    observed_before: list[int]


class GrammarTable:
    """The constrained sequences of one device and their matchers (see the module docstring).

    Args:
        grammars: the compiled-grammar cache.
        vocab_size: V, the logits' width (the bitmask covers it).
        device: where the logits live.

    A matcher ends its sequence with one of the stop tokens of the compiler's ``TokenizerInfo``
    (the model's EOS ids), allowed exactly where the grammar may end.
    """

    def __init__(self, grammars: CompiledGrammars, vocab_size: int, device: torch.device) -> None:
        self.grammars, self.vocab_size, self.device = grammars, vocab_size, device
        self._words = (vocab_size + 31) // 32
        self._fused = device.type == "cpu" and cpu_kernels.load_cpu_kernels()
        self._states: dict[int, SequenceGrammar] = {}  # seq_index -> state (submitting thread)
        self._observed = threading.Condition()

    def active_count(self) -> int:
        """Constrained sequences whose grammar state is held (started, not finished)."""
        return len(self._states)

    def reset(self) -> None:
        """Forget every sequence (a new prepare stream); steps still in flight keep their states."""
        self._states = {}

    # ---- submitting thread -------------------------------------------------------------------

    def stage(self, step: Step) -> GrammarRows | None:
        """Register the step's new constrained sequences, stage its constrained sampling rows and
        drop its finished and aborted sequences (an abort rides in a plan at once, a finish only
        in the next one). ``None`` when no sampling row is constrained."""
        for start in step.started:
            self._states.pop(start.seq_index, None)
            if start.constraint is not None:
                self._states[start.seq_index] = self._start(start)
        staged = None
        if self._states:
            staged = self._stage_rows(step)
        for seq_index in step.finished:
            self._states.pop(seq_index, None)
        if step.plan.aborted and self._states:
            aborted = set(step.plan.aborted)
            for seq_index in [s for s, state in self._states.items() if state.request_id in aborted]:
                del self._states[seq_index]
        return staged

    def _start(self, start: StartedSequence) -> SequenceGrammar:
        compiled = self.grammars.get(start.constraint)
        state = SequenceGrammar(start.generation, start.request_id, ready=Future())

        earlier_output = start.prompt_token_ids[len(start.prompt_token_ids) - start.output_offset:]  # a resumed sequence's

        def make_matcher() -> None:
            try:
                state.matcher = xgrammar.GrammarMatcher(compiled.result())
                for token_id in earlier_output:  # where the failed device's matcher was
                    if not state.matcher.accept_token(token_id):
                        raise ConstraintError(f"the resumed sequence's earlier token {token_id} does not match the constraint")
                state.bitmask = torch.empty(self._words, dtype=torch.int32)
                self._fill(state)
            except ConstraintError as exc:
                state.error = f"structured output: {exc}"
            except Exception as exc:  # noqa: BLE001 - this sequence fails, the device goes on
                state.error = f"structured output: the constraint could not be compiled ({readable_error(exc)})"
            state.ready.set_result(None)

        self.grammars.submit(make_matcher)
        return state

    def _stage_rows(self, step: Step) -> GrammarRows | None:
        rows, states, before = [], [], []
        for row, (seq_index, generation) in enumerate(zip(step.sampled_seq_index, step.sampled_generation)):
            state = self._states.get(seq_index)
            if state is None or state.generation != generation:
                continue
            rows.append(row)
            states.append(state)
            before.append(state.submitted)
            state.submitted += 1
        if not rows:
            return None
        return GrammarRows(rows, states, before)

    # ---- the step's device work ------------------------------------------------------------

    def mask_logits(self, staged: GrammarRows, logits: torch.Tensor, logit_rows: list[int] | None = None) -> None:
        """Set the logits of tokens a constrained row's grammar forbids to -inf, in place.

        ``logits``: ``[S, V]`` of the step's sampling rows, any float dtype, on ``device``;
        ``logit_rows``: each constrained row's row of ``logits`` when they differ from its sampling
        row (speculative decoding: a row's entries precede the next row's). Waits
        on the host until each constrained row's previous token has been observed (its mask is
        then final); unconstrained rows are untouched. A row whose sequence already failed or
        ended keeps every token (its output is discarded by reclaim).

        Raises:
            TimeoutError: a row's grammar was not ready within `MASK_WAIT_S` (the step fails).
        """
        masks = torch.empty(logits.shape[0], self._words, dtype=torch.int32)
        deadline = time.monotonic() + MASK_WAIT_S
        targets = staged.rows if logit_rows is None else logit_rows
        for row, target, state, before in zip(staged.rows, targets, staged.states, staged.observed_before):
            state.ready.result(timeout=max(0.0, deadline - time.monotonic()))
            with self._observed:
                if not self._observed.wait_for(lambda: state.observed >= before, max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"structured output: row {row}'s previous token was not observed within {MASK_WAIT_S} s")
            usable = state.error is None and not state.matcher.is_terminated()
            if usable:
                masks[target].copy_(state.bitmask)
            else:
                masks[target].fill_(_ALL_ALLOWED)
        _apply_bitmask(logits, masks, targets, self._fused and logits.dtype in (torch.bfloat16, torch.float32))

    # ---- resolving thread --------------------------------------------------------------------

    def observe(self, staged: GrammarRows, token_ids: list[int] | None) -> dict[int, str]:
        """Advance each constrained row's matcher by the token it sampled; fill its next bitmask.

        ``token_ids``: the step's sampled ids in sampling-row order; ``None`` when the step failed
        (its sequences fail with it: their states only count the row). Returns ``{sampling row:
        message}`` of the rows whose request fails: the grammar rejected the token, or the
        constraint could not be compiled. Called once per step, in submission order.
        """
        errors = {}
        for row, state in zip(staged.rows, staged.states):
            if token_ids is None:
                state.error = state.error or "structured output: an earlier step of this sequence failed"
                state.error_reported = True
            elif state.error is None and not state.matcher.is_terminated():
                token = token_ids[row]
                if state.matcher.accept_token(token):
                    self._fill(state)
                else:
                    state.error = f"structured output: the constraint rejected sampled token {token}"
            if state.error is not None and not state.error_reported:
                errors[row] = state.error
                state.error_reported = True
            with self._observed:
                state.observed += 1
                self._observed.notify_all()
        return errors

    @staticmethod
    def _fill(state: SequenceGrammar) -> None:
        if not state.matcher.is_terminated():
            state.matcher.fill_next_token_bitmask(state.bitmask.unsqueeze(0))


def _apply_bitmask(logits: torch.Tensor, masks: torch.Tensor, rows: list[int], fused: bool) -> None:
    """``logits[rows]`` [R, V] set to -inf where ``masks[rows]`` (host ``[S, ceil(V/32)]`` int32,
    bit ``t % 32`` of word ``t // 32``) is 0. ``fused``: the CPU kernel of `cpu_kernels` (AVX-512;
    32 rows of 49152 bfloat16 logits in 0.16 ms, where xgrammar's scalar CPU kernel takes 5.4 ms
    and made a constrained step 8.4 ms longer, on a 2-core Intel Xeon with AMX); else, on the cpu, xgrammar's kernel; on
    accelerators xgrammar's torch implementation on the uploaded masks (no triton needed)."""
    if fused:
        cpu_kernels.apply_token_bitmask_(logits, masks, rows)
    elif logits.device.type == "cpu":
        xgrammar.apply_token_bitmask_inplace(logits, masks, indices=rows, backend="cpu")
    else:
        # The pinned copy stays alive until the upload has run (torch's caching host allocator).
        uploaded = masks.pin_memory().to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, uploaded, indices=rows, backend="torch_native")
