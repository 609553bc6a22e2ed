"""Iteration-level continuous batching: which rows the next step carries.

The API is symmetric, as in vLLM v1 and nano-vllm: :meth:`Scheduler.schedule` builds the next
:class:`ScheduledStep`, :meth:`Scheduler.update_from_output` takes a step's published
``StepEvents`` back (and :meth:`Scheduler.fail_step` a step the device refused). No gRPC and no
threads here: the step loop drives it under one lock, and unit tests drive it with hand-built events.

One step, built in this order within ``max_step_tokens`` tokens:

1. ``finished`` = seq indices freed since the last plan, ``aborted`` = request ids aborted since,
   ``released`` = the blocks the sliding window has left behind (below).
2. a decode row (1 token, the placeholder ``-1``) for every running sequence past its prompt.
   These always fit: a sequence starts decoding only after a prompt row that sampled, and that
   row took a budget token of the step before, so decode rows never outnumber ``max_step_tokens``.
   With speculative decoding (``num_speculative_tokens`` K > 0) a decode row also asks for up to K
   drafts (as `draft_planner` chooses), one more placeholder each, from the budget left after every decode
   row has its token, and never past ``max_tokens``. Its ``start_pos`` assumes the steps in flight
   accepted every draft (an upper bound: blocks are reserved for the worst case); each published
   event lowers ``num_kv_tokens`` by the drafts that row did not accept, and the device takes the
   real positions from its own state. A sequence whose bound may already have reached
   ``max_tokens`` waits for its events. Only prompt blocks are ever shared, and they are written by
   prefill rows, which speculation does not change;
3. the next prefill chunk (at most ``max_prefill_chunk`` tokens) of every admitted sequence still
   in its prompt, first admitted first;
4. admissions from the waiting queue, each with its first chunk: first come, first served within
   an API key, the keys in turns (``waiting_queues.py``; a key at its ``max_running`` is passed
   over); without keys, first come, first served.

**Admission policy (never deadlocks, no preemption).** A request is admitted when a seq index is
free and the KV pool can *reserve* the most blocks it can hold at once: a block for every position
it may ever write, ``prompt + max_tokens - 1`` tokens (the last sampled token is never fed back),
or, on a windowed model, its bound H when that is fewer (*Sliding window*, below). With a prefix
hit it takes no more: the cached blocks it starts with are not reserved again, but those no
sequence held stop being evictable, and sharing blocks with windowed reservations sets aside the
blocks that back their refunds (``block_manager.py``). Blocks leave the pool only as rows reach
them, but a running sequence can always grow (free and evictable blocks together always cover the
reservations, and a windowed one's reservation plus what it holds never falls below H), so every
admitted sequence runs to its end and returns its blocks. A request whose reservation could not
fit even the empty pool is refused at :meth:`add_request` with ``RESOURCE_EXHAUSTED`` naming the
sizes. Once the running sequences are done every block is free or evictable and nothing is set
aside, and a hit never makes a request need more than without one, so the head of the waiting
queue always fits then; it is never overtaken (no starvation; with keys, the head is the request
whose turn it is). The cost: a request that stops early held its reservation meanwhile.

**Prefix caching** (``prefix_cache.py``, on unless ``enable_prefix_caching`` is false). A new
sequence starts with the longest cached prefix of its prompt's full blocks, at most
``(prompt - 1) // block_size`` blocks so that its last prompt token is always computed (its
logits are sampled), and on a windowed model at most the pool less its first chunk (below): its
first row has ``start_pos`` past the hit, and its first ``new_block_ids`` are the shared
blocks. A prompt block becomes shareable only when the step that wrote its last token is
published without error (:meth:`update_from_output`); a sequence any of whose steps failed or was
refused never makes a block shareable. The cache lives and dies with the scheduler, i.e. with one
attachment of one device.

**Sliding window** (``kv_window`` W > 0: every layer of the device's model is windowed). A query at
position q reads keys ``q - W < k <= q`` only. A running sequence's published steps wrote
``num_kv_tokens - num_tokens_in_flight`` = P positions (a prefix hit's count as published); every
row in flight or still to come computes positions >= P (a speculative row's real position too: the
upper bound less its unaccepted drafts), so blocks whose last position is <= P - W are read by none
of them: each step releases them before it adds rows (`BlockManager.release_prefix`) and lists
them in its plan's ``released``, which the device applies before the plan's rows, so the plan may
hand them on. A refused plan's releases are listed again. A model with a global layer releases
nothing.

What a windowed sequence holds (`_max_held_blocks`): at most D = ``pipeline_depth`` steps are
unpublished, this one included (the engine's credits), each with at most one row of the sequence:
a prompt chunk of at most C = ``max_prefill_chunk`` tokens, or a decode row of at most S = 1 + K.
So after a step's releases and rows it holds the blocks from ``floor((P - W + 1) / B)`` (0 while
negative; B = ``kv_block_size``) to the one of its last position scheduled, E - 1, where E <= P +
D * max(C, S); once P reaches the prompt's end every row in flight is a decode row, E <= P + D * S,
and before that any decode row in flight follows a prompt row, E <= prompt + (D - 1) * S
(``num_kv_tokens`` = E only overstates while drafts are in flight). As ``ceil((a + L) / B) -
floor(a / B) <= ceil((L + B - 1) / B)`` for a >= 0, it holds at most

    H = max(span(S), min(span(max(C, S)), ceil((prompt + (D - 1) * S) / B)))
    span(t) = ceil((W + D * t + B - 2) / B)

blocks however long it runs, and admission reserves H when that is below its whole length (the
block manager gives a block of reservation back for every block released, so its reservation plus
what it holds stays H). Its first row comes before any release of it: with a prefix hit of h
blocks it holds at most h + ceil(C / B) then, so a hit longer than H - ceil(C / B) makes that its
bound (the sequence reserves, for its life, what it held at first, never more than its whole length),
and a hit is cut only where that would not fit the whole pool (a shared block costs an admission at
most one available block, so the head of the queue still fits once nothing runs). vLLM's ``SlidingWindowManager`` (``vllm/v1/core/single_type_kv_cache_manager.py``)
releases the same blocks but allocates on demand and preempts, so it needs no bound.

**Finish lag.** A sequence gets no more rows once reclaim reports its finish, once it has been
given ``max_tokens`` sampling rows, or once it is aborted or failed. Its blocks and seq index are
freed only when it is finished (its terminal event was published, or prepare ended it locally) and
no unpublished step has a row of it; then its index is listed in the next plan's ``finished`` and
reused only after that plan, with the generation bumped.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable, Sequence

from stageserve.prepare.block_manager import BlockManager
from stageserve.prepare.draft_planner import DraftPlanner, SequenceDrafts, may_draft
from stageserve.prepare.draft_replay import DraftReplay
from stageserve.prepare.errors import QUEUE_FULL_RETRY_S, resource_exhausted
from stageserve.prepare.prefix_cache import BlockHash, cache_namespace, chain_hashes
from stageserve.prepare.scheduled_step import ScheduledStep, SequenceState
from stageserve.prepare.scheduler_config import SchedulerConfig
from stageserve.prepare.validation import GenerationRequest
from stageserve.prepare.waiting_queues import WaitingQueues
from stageserve.v1 import common_pb2, reclaim_pb2


class AbortOutcome(enum.Enum):
    """What :meth:`Scheduler.abort` did."""

    NOT_FOUND = "not_found"              # unknown, or its finish was already reported
    REMOVED_WAITING = "removed_waiting"  # never reached the device; the caller ends the request
    FORWARDED = "forwarded"              # no more rows; reclaim publishes its terminal event


class Scheduler:
    """Waiting queue, running sequences, KV blocks and seq indices of one device session.

    Args:
        config: the limits (see :class:`SchedulerConfig`).
        generations: last generation used per seq index, carried over from a previous session so
            that numbers keep increasing (ignored unless it has ``max_num_seqs`` entries).
        stale_seq_indices: indices a previous session left in use on the same device instance;
            listed in the first plan's ``finished`` and reused only after it.
        first_step_id: the first step's id; a new session continues its predecessor's numbering so
            that a late ``StepEvents`` of an old step can never be taken for a new one.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        generations: Sequence[int] = (),
        stale_seq_indices: Iterable[int] = (),
        first_step_id: int = 1,
    ) -> None:
        self.config = config
        self.block_manager = BlockManager(config.kv_num_blocks, config.kv_block_size)
        self._generations = list(generations) if len(generations) == config.max_num_seqs else [0] * config.max_num_seqs
        self._pending_finished = sorted(set(stale_seq_indices))
        self._free_indices = deque(i for i in range(config.max_num_seqs) if i not in set(self._pending_finished))
        self._pending_aborts: list[str] = []
        self._waiting = WaitingQueues()
        self._running_of: dict[str, int] = {}  # tenant -> its sequences holding a seq index
        self._block_hashes: dict[GenerationRequest, list[BlockHash]] = {}  # waiting requests' hash chains
        self._waiting_kv_blocks = 0  # blocks the waiting requests will reserve at admission
        self._running: list[SequenceState] = []  # admission order
        self._by_index: dict[int, SequenceState] = {}
        self._by_request: dict[GenerationRequest, SequenceState] = {}
        self._in_flight: dict[int, ScheduledStep] = {}
        self._next_step_id = first_step_id
        self._draft_planner = DraftPlanner(config.num_speculative_tokens, config.step_costs)

    # ---- figures -------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_waiting_kv_blocks(self) -> int:
        """KV blocks the waiting requests will reserve when admitted (placement weighs them)."""
        return self._waiting_kv_blocks

    @property
    def num_running(self) -> int:
        """Sequences holding a seq index (including those waiting for their last step to publish)."""
        return len(self._running)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def next_step_id(self) -> int:
        return self._next_step_id

    @property
    def generations(self) -> list[int]:
        """Last generation used per seq index (to carry over into a new session)."""
        return list(self._generations)

    @property
    def seq_indices_in_use(self) -> list[int]:
        """Indices the device may still hold state for (held, or freed but not yet listed)."""
        return sorted([*self._by_index, *self._pending_finished])

    @staticmethod
    def max_kv_tokens(request: GenerationRequest) -> int:
        """KV entries a request writes at most: its prompt and every sampled token but the last."""
        return request.num_prompt_tokens + request.max_tokens - 1

    def _max_held_blocks(self, request: GenerationRequest, hit_blocks: int = 0) -> int | None:
        """H, the most KV blocks ``request``'s sequence holds at once on a windowed model, starting with
        a prefix hit of ``hit_blocks`` (module docstring, *Sliding window*); ``None`` without a window."""
        config = self.config
        if not config.kv_window:
            return None
        depth, block, decode = config.pipeline_depth, config.kv_block_size, 1 + config.num_speculative_tokens

        def span(row_tokens: int) -> int:  # the window and `depth` rows of `row_tokens` in flight
            return -(-(config.kv_window + depth * row_tokens + block - 2) // block)

        in_prompt = -(-(request.num_prompt_tokens + (depth - 1) * decode) // block)
        first_row = hit_blocks + -(-config.max_prefill_chunk // block) if hit_blocks else 0  # held before any release
        return max(span(decode), min(span(max(config.max_prefill_chunk, decode)), in_prompt), first_row)

    def _reservation(self, request: GenerationRequest) -> int:
        """KV blocks ``request`` reserves at admission without a prefix hit."""
        return self.block_manager.reservation(self.max_kv_tokens(request), self._max_held_blocks(request))

    # ---- requests in -----------------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> None:
        """Queue a validated request for admission.

        Raises:
            RequestError: as :meth:`check_request`.
        """
        needed = self.check_request(request)
        self._waiting.append(request)
        self._waiting_kv_blocks += needed
        self._block_hashes[request] = self.block_hashes(request)

    def check_request(self, request: GenerationRequest) -> int:
        """Whether :meth:`add_request` would take ``request`` now: the KV blocks it will reserve.

        Raises:
            RequestError: ``RESOURCE_EXHAUSTED`` when the waiting queue is full, or when the request
                needs more KV blocks than the whole pool has.
        """
        limits = request.tenant_limits
        if limits.max_waiting is not None and self._waiting.waiting_of(request.tenant) - self._admissible(request) >= limits.max_waiting:
            raise resource_exhausted(f"API key {request.tenant!r} has {limits.max_waiting} requests waiting, its maximum; retry later",
                                     reason="QUEUE_FULL", retry_after_s=QUEUE_FULL_RETRY_S)
        # Requests the free sequence slots will take at the next step are not waiting in the queue.
        if len(self._waiting) - len(self._free_indices) >= self.config.max_waiting:
            raise resource_exhausted(f"the waiting queue is full ({self.config.max_waiting} requests); retry later",
                                     reason="QUEUE_FULL", retry_after_s=QUEUE_FULL_RETRY_S)
        kv_tokens = self.max_kv_tokens(request)
        needed, block_size = self._reservation(request), self.block_manager.block_size
        if needed > self.block_manager.num_blocks:
            if needed < self.block_manager.blocks_for_tokens(kv_tokens):
                size = (f"at once ({self.config.kv_window}-token window, prompt {request.num_prompt_tokens},"
                        f" {self.config.pipeline_depth} steps in flight, {block_size} tokens per block)")
                change = "the window, not max_tokens, sets that: give the device a larger --kv-cache-memory"
            else:
                size = f"(prompt {request.num_prompt_tokens} + max_tokens {request.max_tokens} - 1 = {kv_tokens} tokens, {block_size} per block)"
                change = "lower max_tokens or shorten the prompt"
            raise resource_exhausted(
                f"the request needs {needed} KV blocks {size} but the KV cache has {self.block_manager.num_blocks} blocks in all; {change}"
            )
        return needed

    def block_hashes(self, request: GenerationRequest) -> list[BlockHash]:
        """The hash chain of ``request``'s full prompt blocks (none with prefix caching off, nor for a
        mean-pooled embedding: it needs every prompt token's hidden state, so it starts from no hit)."""
        if not self.config.enable_prefix_caching or request.pooling == common_pb2.POOLING_MEAN:
            return []
        namespace = cache_namespace(self.config.model_identity, request.cache_salt, request.cache_tenant)
        return chain_hashes(request.prompt_token_ids, self.config.kv_block_size, namespace)

    def prefix_hit(self, request: GenerationRequest, hashes: list[BlockHash] | None = None) -> list[int]:
        """The cached blocks ``request`` would start with if admitted now (see the module docstring)."""
        if hashes is None:
            hashes = self._block_hashes.get(request) or self.block_hashes(request)
        limit = (request.num_prompt_tokens - 1) // self.config.kv_block_size
        if self.config.kv_window:  # its first row holds the hit and a chunk before any release: within the pool
            limit = max(0, min(limit, self.config.kv_num_blocks - self.block_manager.blocks_for_tokens(self.config.max_prefill_chunk)))
        return self.block_manager.cache.longest_prefix(hashes[:limit])

    def abort(self, request: GenerationRequest) -> AbortOutcome:
        """Stop scheduling ``request``: drop it from the waiting queue, or forward the abort to reclaim."""
        seq = self._by_request.get(request)
        if seq is None:
            if request in self._waiting:
                self._waiting.remove(request)
                del self._block_hashes[request]
                self._waiting_kv_blocks -= self._reservation(request)
                return AbortOutcome.REMOVED_WAITING
            return AbortOutcome.NOT_FOUND
        if seq.finished:
            return AbortOutcome.NOT_FOUND
        seq.stopped = True
        if not seq.abort_forwarded:
            seq.abort_forwarded = True
            self._pending_aborts.append(request.request_id)
        return AbortOutcome.FORWARDED

    # ---- schedule --------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Whether :meth:`schedule` would return a step now."""
        if self._pending_aborts or any(self._has_row(seq) for seq in self._running):
            return True
        if not self._waiting:
            return False
        # Listing freed indices in a plan is what lets a waiting request take one.
        return bool(self._pending_finished) or self._can_admit(self._next_admission())

    def schedule(self) -> ScheduledStep | None:
        """Build the next step (see the module docstring for the order), or ``None`` if there is
        nothing to send. The step counts as in flight until published or refused."""
        if not self.has_work():
            return None
        step = ScheduledStep(step_id=self._next_step_id, finished=self._pending_finished, aborted=self._pending_aborts,
                             speculative=self.config.num_speculative_tokens > 0)
        self._pending_finished, self._pending_aborts = [], []
        if self.config.kv_window:
            self._release_left_behind(step)
        budget = self.config.max_step_tokens
        budget = self._schedule_decode_rows(step, budget)
        budget = self._schedule_prefill_chunks(step, budget)
        self._admit(step, budget)
        self._free_indices.extend(step.finished)  # the device drops them after this step
        if step.is_empty:
            return None
        self._in_flight[step.step_id] = step
        self._next_step_id += 1
        return step

    def _release_left_behind(self, step: ScheduledStep) -> None:
        """Release the blocks each running sequence's window has left behind, and list in ``step``
        every sequence whose releases the device has not been told (see the module docstring)."""
        window, block_size = self.config.kv_window, self.config.kv_block_size
        for seq in self._running:
            if not seq.stopped:
                published = seq.num_kv_tokens - seq.num_tokens_in_flight
                self.block_manager.release_prefix(seq.blocks, (published - window + 1) // block_size)
            if seq.blocks.num_released > seq.num_released_sent:
                seq.num_released_sent = seq.blocks.num_released
                step.released.append((seq, seq.num_released_sent))

    def _schedule_decode_rows(self, step: ScheduledStep, budget: int) -> int:
        decoding = [seq for seq in self._running if not seq.in_prefill and self._has_row(seq)]
        drafts = [0] * len(decoding)
        if self.config.num_speculative_tokens:
            spare = budget - len(decoding)  # budget tokens left for drafts once every row has its one
            context = sum(seq.num_kv_tokens for seq in decoding) / len(decoding) if decoding else 0.0
            drafts = self._draft_planner.plan([(seq.drafts, self._draft_room(seq)) for seq in decoding], spare, context)
        for seq, k in zip(decoding, drafts):
            budget -= step.add_row(seq, 1, self.block_manager, k)
        return budget

    def _draft_room(self, seq: SequenceState) -> int:
        """Drafts a decode row of ``seq`` may carry before its tokens would pass ``max_tokens``
        (``num_kv_tokens`` is an upper bound of its pending token's position)."""
        return seq.request.num_prompt_tokens + seq.request.max_tokens - 2 - seq.num_kv_tokens

    def _has_row(self, seq: SequenceState) -> bool:
        """Whether ``seq`` gets a row in the next step. Not when stopped, nor (speculative decoding)
        when the steps in flight may have taken it to ``max_tokens``: it waits for their events."""
        return not seq.stopped and (seq.in_prefill or not self.config.num_speculative_tokens or self._draft_room(seq) >= 0)

    def _schedule_prefill_chunks(self, step: ScheduledStep, budget: int) -> int:
        for seq in self._running:
            if budget == 0:
                break
            if not seq.stopped and seq.in_prefill:
                budget -= step.add_row(seq, min(seq.request.num_prompt_tokens - seq.num_kv_tokens, self.config.max_prefill_chunk, budget), self.block_manager)
        return budget

    def _tenant_room(self, request: GenerationRequest) -> float:
        """Sequences ``request``'s tenant may still start before its ``max_running`` (inf: no limit)."""
        limit = request.tenant_limits.max_running
        return math.inf if limit is None else limit - self._running_of.get(request.tenant, 0)

    def _admissible(self, request: GenerationRequest) -> int:
        """Requests of ``request``'s tenant the free seq indices would take at the next step (not
        counted as waiting, as for the whole queue's bound)."""
        return int(max(0, min(len(self._free_indices), self._tenant_room(request))))

    def _next_admission(self) -> GenerationRequest | None:
        """The waiting request whose turn it is (`WaitingQueues`), of a tenant below its ``max_running``."""
        return self._waiting.head(self._may_run)

    def _may_run(self, request: GenerationRequest) -> bool:
        return self._tenant_room(request) > 0

    def _can_admit(self, request: GenerationRequest | None) -> bool:
        if request is None or not self._free_indices:
            return False
        shared = self.prefix_hit(request)
        return self.block_manager.can_allocate(self.max_kv_tokens(request), shared, self._max_held_blocks(request, len(shared)))

    def _admit(self, step: ScheduledStep, budget: int) -> None:
        while budget > 0 and self._can_admit(request := self._next_admission()):
            self._waiting.pop(request, request.tenant_limits.weight)
            self._running_of[request.tenant] = self._running_of.get(request.tenant, 0) + 1
            self._waiting_kv_blocks -= self._reservation(request)
            index = self._free_indices.popleft()
            self._generations[index] += 1
            hashes = self._block_hashes.pop(request)
            shared = self.prefix_hit(request, hashes)
            blocks = self.block_manager.allocate(self.max_kv_tokens(request), shared, self._max_held_blocks(request, len(shared)))
            seq = SequenceState(request, index, self._generations[index], blocks,
                                num_kv_tokens=len(shared) * self.config.kv_block_size, block_hashes=hashes,
                                num_cached_tokens=len(shared) * self.config.kv_block_size,
                                drafts=self._new_drafts(request))
            self._running.append(seq)
            self._by_index[index] = seq
            self._by_request[request] = seq
            step.started.append(seq)
            budget -= step.add_row(seq, min(request.num_prompt_tokens - seq.num_kv_tokens, self.config.max_prefill_chunk, budget), self.block_manager)

    def _new_drafts(self, request: GenerationRequest) -> SequenceDrafts:
        """A new sequence's drafting state: none when its sampling forbids drafts, a replay of prompt
        lookup when the device proposes by it and prepare plans by measured costs."""
        k = self.config.num_speculative_tokens if may_draft(request) else 0
        replays = bool(k) and self.config.step_costs is not None and self.config.speculative_method == "ngram"
        return SequenceDrafts(k, replay=DraftReplay(list(request.prompt_token_ids), k) if replays else None)

    # ---- outputs back ------------------------------------------------------------------------------
    def update_from_output(self, step_events: reclaim_pb2.StepEvents) -> list[tuple[GenerationRequest, reclaim_pb2.SequenceEvent]]:
        """Take one published step: note finishes, release the step, free what is done.

        Returns:
            ``(request, event)`` for every event of a live sequence (matched by seq index,
            generation and request id), in event order; events of anything else are stale and dropped.
        """
        routed = []
        touched = []
        step = self._in_flight.pop(step_events.step_id, None)
        decode_drafts = step.decode_drafts if step is not None else {}
        for event in step_events.events:
            seq = self._by_index.get(event.seq_index)
            if seq is None or seq.generation != event.generation or seq.request.request_id != event.request_id:
                continue
            routed.append((seq.request, event))
            if event.finish_reason or event.error_code:
                seq.stopped = seq.finished = True
                touched.append(seq)
            elif self.config.num_speculative_tokens:
                self._observe_drafts(seq, event, decode_drafts.get(seq))
            seq.cache_poisoned |= bool(event.error_code)
        if step is not None:
            if step_events.error_code:
                self._poison(step)
                routed += self._fail_rows_without_event(step, step_events)
            else:
                self._cache_written_blocks(step)
            touched.extend(self._release_rows(step))
        self._free_done(touched)
        return routed

    def _observe_drafts(self, seq: SequenceState, event: reclaim_pb2.SequenceEvent, asked: int | None) -> None:
        """A live sequence's published row (``asked``: the drafts a decode row asked for; ``None``: a
        prompt row): lower its bound by the drafts it did not accept, and update its estimates from
        its replay of prompt lookup (every row) or, without one, from the drafts it asked for."""
        drafts = seq.drafts
        if asked is not None:
            accepted = len(event.token_ids) - 1
            seq.num_kv_tokens -= asked - accepted  # the drafts it did not accept
            if drafts.replay is None:
                proposed, drafts.proposed = event.draft_tokens - drafts.proposed, event.draft_tokens
                self._draft_planner.observe(drafts, asked, proposed, accepted)
        if drafts.replay is not None:
            for proposed, accepted in drafts.replay.publish(list(event.token_ids), decode_row=asked is not None):
                self._draft_planner.observe(drafts, drafts.max_drafts, proposed, accepted)

    @staticmethod
    def _poison(step: ScheduledStep) -> None:
        """``step`` failed or was refused: its sequences' KV may be incomplete; none becomes shareable."""
        for seq in step.rows:
            seq.cache_poisoned = True

    def _cache_written_blocks(self, step: ScheduledStep) -> None:
        """``step`` was published without error: the prompt blocks it completed become shareable."""
        for seq, j in step.cache_writes:
            if not seq.cache_poisoned:
                self.block_manager.cache_block(seq.blocks.block_ids[j], seq.block_hashes[j])

    def _fail_rows_without_event(self, step: ScheduledStep, step_events: reclaim_pb2.StepEvents) -> list[tuple[GenerationRequest, reclaim_pb2.SequenceEvent]]:
        """A failed step's sequences that reclaim could not name (rows that did not sample) fail too."""
        failed = []
        for seq in dict.fromkeys(step.rows):
            if seq.finished:
                continue
            seq.stopped = seq.finished = True
            event = reclaim_pb2.SequenceEvent(
                request_id=seq.request.request_id, seq_index=seq.seq_index, generation=seq.generation,
                error_code=step_events.error_code, error_message=step_events.error_message,
            )
            failed.append((seq.request, event))
        return failed

    def fail_step(self, step_id: int) -> list[GenerationRequest]:
        """The device refused step ``step_id`` (nothing ran): end every request with a row in it.

        The plan's ``aborted`` ids and still-free ``finished`` indices are listed again in the next
        plan; failed sequences that reclaim already knows are aborted there too, so it drops them.

        Returns:
            the requests to fail (each once; the caller sends their terminal error).
        """
        step = self._in_flight.pop(step_id, None)
        if step is None:
            return []
        self._pending_aborts[:0] = step.aborted
        for index in step.finished:
            if index not in self._by_index and index in self._free_indices:
                self._free_indices.remove(index)
                self._pending_finished.append(index)
        self._poison(step)
        for seq, _ in step.released:
            seq.num_released_sent = 0  # the device did not apply them: list them again
        failed = []
        started = set(step.started)
        for seq in dict.fromkeys(step.rows):
            if seq.finished:
                continue
            seq.stopped = seq.finished = True
            failed.append(seq.request)
            if seq not in started and not seq.abort_forwarded:
                seq.abort_forwarded = True
                self._pending_aborts.append(seq.request.request_id)
        self._free_done(self._release_rows(step))
        return failed

    def _release_rows(self, step: ScheduledStep) -> list[SequenceState]:
        for seq, num_tokens in zip(step.rows, step.num_tokens):
            seq.steps_in_flight -= 1
            seq.num_tokens_in_flight -= num_tokens
        return step.rows

    def _free_done(self, candidates: Iterable[SequenceState]) -> None:
        for seq in candidates:
            if seq.finished and seq.steps_in_flight == 0 and self._by_index.get(seq.seq_index) is seq:
                self._running_of[seq.request.tenant] -= 1
                self.block_manager.free(seq.blocks)
                del self._by_index[seq.seq_index]
                del self._by_request[seq.request]
                self._running.remove(seq)
                self._pending_finished.append(seq.seq_index)
