"""The scheduler on a fully windowed model (``kv_window``): a sequence releases the blocks its
window has left behind, never one a row in flight or still to come reads; a model with a global
layer releases nothing; released blocks serve other sequences; the prefix cache only returns blocks
whose KV is still its prefix's; admission reserves the most blocks a sequence holds at once (H),
which it never exceeds, so a pool of H runs a sequence of any length. Every plan also goes through
the device's sequence table, which must accept it (a released block handed on in the same plan)."""

from __future__ import annotations

import grpc
import pytest
import torch

from stageserve.device.sequence_table import SequenceTable
from stageserve.device.step_plan import PlanError, PlanLimits, decode_plan
from stageserve.prepare.block_manager import RELEASED
from stageserve.prepare.errors import RequestError
from stageserve.prepare.scheduled_step import ScheduledStep, build_step_plan
from stageserve.prepare.scheduler import Scheduler
from stageserve.v1 import reclaim_pb2

from .test_scheduler import LENGTH, make_request, make_scheduler

WINDOW, BLOCK = 16, 4
# The most blocks a sequence holds at once, H (scheduler docstring, "Sliding window"), with chunks of
# 8 and two steps in flight: span(t) = ceil((16 + 2t + 2) / 4) for rows of t tokens; decoding, span(1).
BOUND = 5
VOCAB = 1 << 16  # make_request's token ids stay below it


class WindowedPipeline:
    """Drives ``scheduler`` with its ``pipeline_depth`` steps in flight (as the engine's credits),
    publishes as reclaim would (a decode row accepts ``step_id % (drafts + 1)`` of its drafts), feeds
    every plan to a device sequence table, and checks that no row reads a block released while it
    was in flight or before, nor the prefix cache returns a block whose KV is not its prefix's, nor
    the reservations outgrow the free and evictable blocks. A plan the table refuses is failed as
    the engine does (``refused``). ``peak_held``: per request, the most blocks its table held at
    once; ``most_running``: the most sequences running at once. (``benchmarks/window_kv.py``
    measures with it.)"""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.depth = scheduler, scheduler.config.pipeline_depth
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
        self.most_running = 0
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
        assert self.scheduler.block_manager.num_available >= 0, "reservations exceed the free and evictable blocks"
        for flying in self.in_flight:
            for seq in flying.rows:
                key = (flying.step_id, seq.request.request_id)
                self.released_seen[key] = max(self.released_seen.get(key, 0), seq.blocks.num_released)
        for seq in self.scheduler._running:
            held = len(seq.blocks.block_ids) - seq.blocks.num_released
            self.peak_held[seq.request.request_id] = max(self.peak_held.get(seq.request.request_id, 0), held)
        self.most_running = max(self.most_running, self.scheduler.num_running)
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
    assert pipeline.peak_held["a"] == BOUND  # reached: H is no looser than it need be
    total = scheduler.block_manager.blocks_for_tokens(10 + 4 * WINDOW - 1)
    assert scheduler.block_manager.num_window_released >= total - BOUND
    assert scheduler.block_manager.num_used == 0 and scheduler.block_manager.num_available == scheduler.config.kv_num_blocks


def test_chunked_prefill_and_speculative_rows_never_read_a_released_block():
    """Long prompts in chunks of 8 and decode rows with up to 3 drafts, some rejected (their real
    positions fall behind the planned ones): the pipeline's read check holds throughout."""
    scheduler = make_scheduler(kv_window=WINDOW, kv_block_size=BLOCK, num_speculative_tokens=3, max_step_tokens=32, pipeline_depth=3)
    for rid, prompt in (("a", 50), ("b", 23)):
        scheduler.add_request(make_request(rid, prompt_tokens=prompt, max_tokens=3 * WINDOW))
    pipeline = WindowedPipeline(scheduler)
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


@pytest.mark.parametrize(("prompt", "bound"), [(10, BOUND), (40, 9)])
def test_a_pool_smaller_than_a_sequence_but_not_than_its_bound_runs_it_to_max_tokens(prompt, bound):
    """Prompt 10: decode rows bound it, H = span(1) = 5. Prompt 40: its prefill, two chunks of 8
    in flight, H = min(span(8) = 9, ceil((40 + 1) / 4) = 11) = 9. Either spans far more blocks than
    the pool of H has (19, 26); it is admitted, never holds more than H, never finds its reservation
    short (an append beyond it raises), and runs to max_tokens."""
    scheduler = make_scheduler(kv_window=WINDOW, kv_block_size=BLOCK, kv_num_blocks=bound)
    request = make_request("a", prompt_tokens=prompt, max_tokens=4 * WINDOW)
    assert scheduler.block_manager.blocks_for_tokens(scheduler.max_kv_tokens(request)) > bound
    scheduler.add_request(request)
    assert scheduler.num_waiting_kv_blocks == bound
    pipeline = WindowedPipeline(scheduler)
    pipeline.run()
    assert pipeline.produced["a"] == 4 * WINDOW
    assert pipeline.peak_held["a"] <= bound
    assert scheduler.block_manager.num_used == 0 and scheduler.block_manager.num_available == bound


def test_windowed_sequences_are_admitted_together_where_whole_lengths_went_one_at_a_time():
    """Four requests spanning 19 blocks each against a pool of 20: reserving whole lengths (a model
    with a global layer) runs them one at a time; reserving their bound of 5 admits all four in the
    first step, and all run to max_tokens."""
    for window, together, bound in ((0, 1, 19), (WINDOW, 4, BOUND)):
        scheduler = make_scheduler(kv_window=window, kv_block_size=BLOCK, kv_num_blocks=20, max_step_tokens=64)
        for i in range(4):
            scheduler.add_request(make_request(f"r{i}", prompt_tokens=10, max_tokens=4 * WINDOW))
        assert scheduler.num_waiting_kv_blocks == 4 * bound
        pipeline = WindowedPipeline(scheduler)
        assert len(pipeline.schedule().started) == together
        pipeline.run()
        assert pipeline.produced == {f"r{i}": 4 * WINDOW for i in range(4)} and pipeline.most_running == together
        assert max(pipeline.peak_held.values()) <= bound
        assert scheduler.block_manager.num_available == 20


@pytest.mark.parametrize(("depth", "bound"), [(2, 7), (3, 8)])
def test_the_bound_with_speculative_drafts_in_flight(depth, bound):
    """Decode rows of up to 1 + 3 tokens, some drafts rejected (their bound overstates positions
    until published): H = ceil((16 + depth * 4 + 2) / 4), 7 at depth 2 and 8 at depth 3, the prompt
    term ceil((10 + (depth - 1) * 4) / 4) being lower. A pool of H runs the sequence to its end."""
    scheduler = make_scheduler(kv_window=WINDOW, kv_block_size=BLOCK, kv_num_blocks=bound, num_speculative_tokens=3, pipeline_depth=depth)
    scheduler.add_request(make_request("a", prompt_tokens=10, max_tokens=4 * WINDOW))
    assert scheduler.num_waiting_kv_blocks == bound
    pipeline = WindowedPipeline(scheduler)
    pipeline.run()
    assert pipeline.produced["a"] == 4 * WINDOW
    assert pipeline.peak_held["a"] <= bound
    assert scheduler.block_manager.num_available == bound


def test_a_prefix_hit_longer_than_the_bound_is_kept_whole_and_bounds_its_sequence():
    """Prompt 48 spans 12 blocks, more than its H of 9 (span(8)): a later request with that prompt
    starts from all 11 cached blocks its last token allows; its first row then holds 11 + 2 (its
    chunk's) before any release, which is its bound: it reserves 13, never holds more, and runs."""
    scheduler = make_scheduler(kv_window=WINDOW, kv_block_size=BLOCK, kv_num_blocks=40)
    scheduler.add_request(make_request("a", prompt_tokens=48, max_tokens=20))
    pipeline = WindowedPipeline(scheduler)
    pipeline.run()
    later = make_request("b", prompt_tokens=48, max_tokens=20)
    assert len(scheduler.prefix_hit(later)) == 11
    scheduler.add_request(later)
    started = pipeline.schedule().started
    assert [seq.num_cached_tokens for seq in started] == [44]
    assert len(started[0].blocks.block_ids) + started[0].blocks.reserved == 13
    pipeline.run()
    assert pipeline.produced == {"a": 20, "b": 20} and pipeline.prefix_hits == 1
    assert pipeline.peak_held["a"] <= 9 and pipeline.peak_held["b"] <= 13
    assert scheduler.block_manager.num_used == 0 and scheduler.block_manager.num_available == 40


def test_a_prefix_hit_is_cut_only_where_it_and_the_first_chunk_would_not_fit_the_pool():
    """A pool of 12 blocks (H = 9) and a 12-block prompt, all of it cached by a first request that
    only prefills it: the later request's hit is cut from 11 to 10 blocks (12 less its first chunk's
    2), so that it fits the pool once nothing else runs, and it runs within its bound of 12."""
    scheduler = make_scheduler(kv_window=WINDOW, kv_block_size=BLOCK, kv_num_blocks=12)
    scheduler.add_request(make_request("a", prompt_tokens=48, max_tokens=1))
    pipeline = WindowedPipeline(scheduler)
    pipeline.run()
    later = make_request("b", prompt_tokens=48, max_tokens=20)
    assert len(scheduler.block_manager.cache.longest_prefix(scheduler.block_hashes(later))) == 12
    assert len(scheduler.prefix_hit(later)) == 10
    scheduler.add_request(later)
    pipeline.run()
    assert pipeline.produced == {"a": 1, "b": 20} and pipeline.prefix_hits == 1
    assert pipeline.peak_held["a"] <= 9 and pipeline.peak_held["b"] <= 12


def test_windowed_sequences_sharing_held_prompt_blocks_fit_a_pool_of_their_bounds():
    """The second request hits prompt blocks the first still holds; the pool has just the two
    bounds (2 x 9): the hit costs the second its whole bound, 2 blocks of it set aside for the
    refund of whichever releases a shared block first, so a third request (2 blocks) waits for them
    and the reservations never exceed the free and evictable blocks (the pipeline checks)."""
    scheduler = make_scheduler(kv_window=WINDOW, kv_block_size=BLOCK, kv_num_blocks=18)
    scheduler.add_request(make_request("a", prompt_tokens=48, max_tokens=20))
    pipeline = WindowedPipeline(scheduler)
    pipeline.schedule()
    pipeline.publish_oldest()  # a's first chunk published: blocks 0 and 1 cached, still held
    scheduler.add_request(make_request("b", prompt_tokens=48, max_tokens=20))
    other = make_request("c", prompt_tokens=4, max_tokens=5)
    other.prompt_token_ids[:] = [900, 901, 902, 903]
    scheduler.add_request(other)
    started = pipeline.schedule().started
    assert [seq.request.request_id for seq in started] == ["b"] and started[0].num_cached_tokens == 8
    assert [scheduler.block_manager.ref_count(block) for block in started[0].blocks.block_ids[:2]] == [2, 2]
    assert scheduler.block_manager.num_available == 0 and scheduler.num_waiting == 1
    pipeline.run()
    assert pipeline.produced == {"a": 20, "b": 20, "c": 5}
    assert max(pipeline.peak_held.values()) <= 9
    assert scheduler.block_manager.num_used == 0 and scheduler.block_manager.num_available == 18


def test_the_refusal_at_add_request_counts_the_bound():
    """A request is refused only when its bound exceeds the whole pool; one whose whole length is
    below its bound reserves its whole length; without a window, the whole length as before."""
    scheduler = make_scheduler(kv_window=WINDOW, kv_block_size=BLOCK, kv_num_blocks=4)
    scheduler.add_request(make_request("short", prompt_tokens=10, max_tokens=7))  # 16 KV tokens: 4 blocks
    assert scheduler.num_waiting_kv_blocks == 4
    with pytest.raises(RequestError) as refused:
        scheduler.add_request(make_request("long", prompt_tokens=10, max_tokens=4 * WINDOW))  # H = 5
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.value.message.startswith("the request needs 5 KV blocks at once (16-token window, prompt 10, 2 steps in flight,"
                                            " 4 tokens per block) but the KV cache has 4 blocks in all")
    with pytest.raises(RequestError) as global_layer:
        make_scheduler(kv_block_size=BLOCK, kv_num_blocks=18).add_request(make_request("long", prompt_tokens=10, max_tokens=4 * WINDOW))
    assert "needs 19 KV blocks (prompt 10 + max_tokens 64 - 1 = 73 tokens" in global_layer.value.message
