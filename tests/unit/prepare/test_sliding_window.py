"""The scheduler on a fully windowed model (``kv_window``): a sequence releases the blocks its
window has left behind, never one a row in flight or still to come reads; a model with a global
layer releases nothing; released blocks serve other sequences; the prefix cache only returns blocks
whose KV is still its prefix's. Every plan also goes through the device's sequence table, which
must accept it (a released block handed on in the same plan)."""

from __future__ import annotations

import torch

from stageserve.device.sequence_table import SequenceTable
from stageserve.device.step_plan import PlanError, PlanLimits, decode_plan
from stageserve.prepare.block_manager import RELEASED
from stageserve.prepare.scheduled_step import ScheduledStep, build_step_plan
from stageserve.prepare.scheduler import Scheduler
from stageserve.v1 import reclaim_pb2

from .test_scheduler import LENGTH, make_request, make_scheduler

WINDOW, BLOCK = 16, 4
BOUND = -(-WINDOW // BLOCK) + 2  # blocks a sequence may hold at once
VOCAB = 1 << 16  # make_request's token ids stay below it


class WindowedPipeline:
    """Drives ``scheduler`` with ``depth`` steps in flight, publishes as reclaim would (a decode row
    accepts ``step_id % (drafts + 1)`` of its drafts), feeds every plan to a device sequence table,
    and checks that no row reads a block released while it was in flight or before, nor the prefix
    cache returns a block whose KV is not its prefix's. A plan the table refuses is failed as the
    engine does (``refused``). ``peak_held``: per request, the most blocks its table held at once.
    (``benchmarks/window_kv.py`` measures with it.)"""

    def __init__(self, scheduler: Scheduler, depth: int = 2) -> None:
        self.scheduler, self.depth = scheduler, depth
        config = scheduler.config
        self.window, self.block_size = config.kv_window, config.kv_block_size
        self.limits = PlanLimits(max_num_seqs=config.max_num_seqs, vocab_size=VOCAB, num_blocks=config.kv_num_blocks, block_size=self.block_size,
                                 max_step_tokens=config.max_step_tokens, max_model_len=1 << 20,
                                 num_speculative_tokens=config.num_speculative_tokens)
        self.device = SequenceTable(config.max_num_seqs, VOCAB, self.block_size, torch.device("cpu"))
        self.in_flight: list[ScheduledStep] = []
        self.released_seen: dict[tuple[int, str], int] = {}  # (step id, request id) -> most blocks released while in flight
        self.written: dict[str, int] = {}  # request id -> positions really written (published)
        self.produced: dict[str, int] = {}
        self.peak_held: dict[str, int] = {}
        self.content: dict[int, object] = {}  # block id -> what its KV holds: a prefix hash, or (request id, block index)
        self.requests = {}  # request id -> its hash chain
        self.handed_on_in_same_plan = 0
        self.prefix_hits = 0
        self.refused: list[ScheduledStep] = []

    def schedule(self) -> ScheduledStep | None:
        step = self.scheduler.schedule() if len(self.in_flight) < self.depth else None
        if step is not None:
            tables_before = {seq: list(self.device._block_tables[seq.seq_index]) for seq, _ in step.released}
            try:
                admitted = self.device.admit(decode_plan(build_step_plan(step), self.limits, lambda params: None))
            except PlanError:
                self.refused.append(step)
                self.scheduler.fail_step(step.step_id)
                return step
            released = {block for seq, count in step.released for block in tables_before[seq][:count]}
            self.handed_on_in_same_plan += bool(released.intersection(step.new_block_ids))
            self._note_writes(step, admitted.block_tables)
            self.in_flight.append(step)
        self._check_prefix_cache()
        for flying in self.in_flight:
            for seq in flying.rows:
                key = (flying.step_id, seq.request.request_id)
                self.released_seen[key] = max(self.released_seen.get(key, 0), seq.blocks.num_released)
        for seq in self.scheduler._running:
            held = len(seq.blocks.block_ids) - seq.blocks.num_released
            self.peak_held[seq.request.request_id] = max(self.peak_held.get(seq.request.request_id, 0), held)
        return step

    def _note_writes(self, step: ScheduledStep, tables: list[list[int]]) -> None:
        for seq, start, n, table in zip(step.rows, step.start_pos, step.num_tokens, tables):
            rid = seq.request.request_id
            self.requests[rid] = seq.block_hashes
            self.prefix_hits += seq in step.started and seq.num_cached_tokens > 0
            for j in range(start // self.block_size, (start + n - 1) // self.block_size + 1):
                self.content[table[j]] = seq.block_hashes[j] if j < len(seq.block_hashes) else (rid, j)

    def _check_prefix_cache(self) -> None:
        cache = self.scheduler.block_manager.cache
        for hashes in self.requests.values():
            for block, block_hash in zip(cache.longest_prefix(hashes), hashes):
                assert self.content[block] == block_hash, f"the prefix cache returned block {block}, whose KV is another prefix's"

    def publish_oldest(self) -> None:
        step = self.in_flight.pop(0)
        events = []
        for seq, start, n, sample in zip(step.rows, step.start_pos, step.num_tokens, step.sample):
            rid = seq.request.request_id
            real_start = self.written.get(rid, 0) if step.decode_drafts.get(seq) is not None else start
            first_read = max(0, real_start - self.window + 1) if self.window else 0
            assert self.released_seen[(step.step_id, rid)] * self.block_size <= first_read, f"step {step.step_id} row of {rid} read a released block"
            if not sample or self.produced.get(rid, 0) >= seq.request.max_tokens:
                self.written[rid] = start + n
                continue
            asked = step.decode_drafts.get(seq, 0)
            tokens = min(1 + step.step_id % (asked + 1), seq.request.max_tokens - self.produced.get(rid, 0))
            self.written[rid] = real_start + (tokens if asked or start >= seq.request.num_prompt_tokens else n)
            self.produced[rid] = self.produced.get(rid, 0) + tokens
            finish = LENGTH if self.produced[rid] == seq.request.max_tokens else 0
            events.append(reclaim_pb2.SequenceEvent(request_id=rid, seq_index=seq.seq_index, generation=seq.generation,
                                                    token_ids=[5] * tokens, finish_reason=finish, draft_tokens=asked))
        self.scheduler.update_from_output(reclaim_pb2.StepEvents(step_id=step.step_id, events=events))

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if self.schedule() is None:
                if not self.in_flight:
                    return
                self.publish_oldest()
        raise AssertionError("the scheduler did not drain")


def test_a_sequence_decoding_to_4x_the_window_holds_a_bounded_number_of_blocks():
    scheduler = make_scheduler(kv_window=WINDOW, kv_block_size=BLOCK)
    scheduler.add_request(make_request("a", prompt_tokens=10, max_tokens=4 * WINDOW))
    pipeline = WindowedPipeline(scheduler)
    pipeline.run()
    assert pipeline.produced["a"] == 4 * WINDOW
    assert pipeline.peak_held["a"] <= BOUND
    total = scheduler.block_manager.blocks_for_tokens(10 + 4 * WINDOW - 1)
    assert scheduler.block_manager.num_window_released >= total - BOUND
    assert scheduler.block_manager.num_used == 0 and scheduler.block_manager.num_available == scheduler.config.kv_num_blocks


def test_chunked_prefill_and_speculative_rows_never_read_a_released_block():
    """Long prompts in chunks of 8 and decode rows with up to 3 drafts, some rejected (their real
    positions fall behind the planned ones): the pipeline's read check holds throughout."""
    scheduler = make_scheduler(kv_window=WINDOW, kv_block_size=BLOCK, num_speculative_tokens=3, max_step_tokens=32)
    for rid, prompt in (("a", 50), ("b", 23)):
        scheduler.add_request(make_request(rid, prompt_tokens=prompt, max_tokens=3 * WINDOW))
    pipeline = WindowedPipeline(scheduler, depth=3)
    pipeline.run()
    assert pipeline.produced == {"a": 3 * WINDOW, "b": 3 * WINDOW}
    assert scheduler.block_manager.num_window_released > 0
    assert max(pipeline.peak_held.values()) <= -(-(WINDOW + 3 * 8) // BLOCK) + 1  # the window plus three steps' tokens


def test_a_model_with_a_global_layer_releases_nothing():
    scheduler = make_scheduler(kv_window=0, kv_block_size=BLOCK)
    scheduler.add_request(make_request("a", prompt_tokens=10, max_tokens=4 * WINDOW))
    pipeline = WindowedPipeline(scheduler)
    pipeline.run()
    assert pipeline.peak_held["a"] == scheduler.block_manager.blocks_for_tokens(10 + 4 * WINDOW - 1)
    assert scheduler.block_manager.num_window_released == 0


def test_released_blocks_are_reused_by_another_sequence_in_the_plan_that_releases_them():
    scheduler = make_scheduler(kv_window=WINDOW, kv_block_size=BLOCK, kv_num_blocks=40)
    scheduler.add_request(make_request("a", prompt_tokens=10, max_tokens=4 * WINDOW))
    pipeline = WindowedPipeline(scheduler)
    while scheduler.block_manager.num_window_released < 2:
        if pipeline.schedule() is None:
            pipeline.publish_oldest()
    scheduler.add_request(make_request("b", prompt_tokens=10, max_tokens=4 * WINDOW))
    pipeline.run()
    assert pipeline.produced == {"a": 4 * WINDOW, "b": 4 * WINDOW}
    assert pipeline.handed_on_in_same_plan > 0  # the device took a block released and handed on in one plan


def test_prefix_cache_only_returns_blocks_holding_their_prefix():
    """Requests sharing a 16-token prefix, more than the pool holds at once: released prompt blocks
    stay cached (evictable, their KV intact) and later requests share them, cached blocks get
    evicted and rewritten, and at every step each block the cache returns holds its prefix's KV."""
    scheduler = make_scheduler(kv_window=WINDOW, kv_block_size=BLOCK, kv_num_blocks=20)
    for i in range(8):
        request = make_request(f"r{i}", prompt_tokens=24, max_tokens=20)
        request.prompt_token_ids[16:] = [500 + 10 * i + j for j in range(8)]
        scheduler.add_request(request)
    pipeline = WindowedPipeline(scheduler)
    pipeline.run()
    assert len(pipeline.produced) == 8 and set(pipeline.produced.values()) == {20}
    assert scheduler.block_manager.num_window_released > 0 and scheduler.block_manager.cache.num_evictions > 0
    assert pipeline.prefix_hits > 0


def test_a_refused_plans_releases_are_listed_again(monkeypatch):
    """The device refuses the first plan that releases blocks of "a" (its row fails "a"): the next
    plan lists the releases again, so the device lets go of them before "b" is handed them."""
    scheduler = make_scheduler(kv_window=WINDOW, kv_block_size=BLOCK, kv_num_blocks=40)
    scheduler.add_request(make_request("a", prompt_tokens=10, max_tokens=4 * WINDOW))
    pipeline = WindowedPipeline(scheduler)
    admit = pipeline.device.admit

    def refuse_the_first_release(step):
        if step.released and not pipeline.refused:
            raise PlanError("refused")
        return admit(step)

    monkeypatch.setattr(pipeline.device, "admit", refuse_the_first_release)
    while not pipeline.refused:
        if pipeline.schedule() is None:
            pipeline.publish_oldest()
    relisted = pipeline.schedule()
    assert [(seq.request.request_id, count) for seq, count in relisted.released] == [(seq.request.request_id, count) for seq, count in pipeline.refused[0].released]
    scheduler.add_request(make_request("b", prompt_tokens=10, max_tokens=4 * WINDOW))
    pipeline.run()
    assert len(pipeline.refused) == 1 and pipeline.produced["b"] == 4 * WINDOW
