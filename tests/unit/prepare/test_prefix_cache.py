"""Prefix caching in prepare's scheduler and block pool, driven with hand-built StepEvents (no gRPC)."""

from __future__ import annotations

import hashlib
import random
from dataclasses import replace

from stageserve.prepare.placement import DeviceLoad, placement_order
from stageserve.prepare.prefix_cache import cache_namespace, chain_hashes
from stageserve.prepare.scheduled_step import ScheduledStep, step_size_args
from stageserve.prepare.scheduler import AbortOutcome, Scheduler
from stageserve.prepare.validation import GenerationRequest
from stageserve.v1 import device_pb2, reclaim_pb2

from tests.unit.prepare.test_scheduler import FakeReclaim, make_scheduler, rows, run_pipeline

BLOCK = 4  # make_scheduler's kv_block_size


def request(request_id: str, prompt: list[int], max_tokens: int = 2, salt: str = "") -> GenerationRequest:
    from tests.unit.prepare.test_scheduler import make_request

    return replace(make_request(request_id, len(prompt), max_tokens), prompt_token_ids=list(prompt), cache_salt=salt)


def serve(scheduler: Scheduler, *requests: GenerationRequest) -> list[ScheduledStep]:
    """Add ``requests`` and run them to their end; every step published without error."""
    for r in requests:
        scheduler.add_request(r)
    return run_pipeline(scheduler, FakeReclaim())


def first_row(steps: list[ScheduledStep], request_id: str) -> tuple[int, int, list[int]]:
    """(start_pos, num_tokens, block ids sent) of ``request_id``'s first row."""
    for step in steps:
        offset = 0
        for r, seq in enumerate(step.rows):
            if seq.request.request_id == request_id:
                return step.start_pos[r], step.num_tokens[r], step.new_block_ids[offset : offset + step.num_new_blocks[r]]
            offset += step.num_new_blocks[r]
    raise AssertionError(f"no row of {request_id}")


def assert_idle_pool_exact(scheduler: Scheduler) -> None:
    """Idle: no block held, no reservation left, every block free or cached-and-evictable."""
    blocks = scheduler.block_manager
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))
    assert blocks.num_free == blocks.num_available == blocks.num_blocks
    assert blocks.cache.num_evictable == blocks.cache.num_cached


PROMPT = list(range(1, 15))  # 14 tokens: 3 full blocks of 4 and 2 more


def test_hash_chain_names_a_block_by_its_whole_prefix_and_namespace():
    ns = cache_namespace("model")
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, ns)
    assert len(a) == 2  # the partial third block has no hash
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, ns) == a
    assert chain_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4, ns)[1] != a[1]  # same tokens, other parent
    assert chain_hashes([1, 2, 3, 4], 4, cache_namespace("model", "tenant")) != a[:1]
    assert chain_hashes([1, 2, 3, 4], 4, cache_namespace("other model")) != a[:1]


def test_hit_counts_only_full_blocks_and_starts_past_them():
    scheduler = make_scheduler()
    serve(scheduler, request("a", PROMPT))
    assert scheduler.block_manager.cache.num_cached == 3  # only the full prompt blocks

    steps = serve(scheduler, request("b", PROMPT[:13] + [99]))
    start, num_tokens, blocks = first_row(steps, "b")
    assert (start, num_tokens) == (12, 2)  # 3 blocks hit, the last 2 prompt tokens computed
    assert blocks[:3] == [0, 1, 2] and len(blocks) == 4  # a's first three blocks, then a fresh one
    assert steps[0].started[0].num_cached_tokens == 12
    assert step_size_args(steps[0])["prefill_tokens_skipped"] == 12
    assert_idle_pool_exact(scheduler)


def test_partial_hit_stops_at_the_first_differing_block():
    scheduler = make_scheduler()
    serve(scheduler, request("a", PROMPT))
    steps = serve(scheduler, request("b", PROMPT[:6] + [77] * 8))
    assert first_row(steps, "b")[:2] == (4, 8)  # 1 block hit; then a chunk of max_prefill_chunk


def test_equal_prompt_of_whole_blocks_still_computes_its_last_token():
    scheduler = make_scheduler()
    prompt = PROMPT[:12]  # exactly 3 blocks
    serve(scheduler, request("a", prompt))
    steps = serve(scheduler, request("b", prompt))
    start, num_tokens, blocks = first_row(steps, "b")
    assert (start, num_tokens) == (8, 4)  # 2 blocks hit: the third holds the last token, recomputed
    assert rows(steps[0])[0][3] is True  # and that row samples
    assert_idle_pool_exact(scheduler)


def test_another_cache_salt_gets_no_hit():
    scheduler = make_scheduler()
    serve(scheduler, request("a", PROMPT, salt="tenant-1"))
    assert first_row(serve(scheduler, request("b", PROMPT, salt="tenant-2")), "b")[0] == 0
    assert first_row(serve(scheduler, request("c", PROMPT)), "c")[0] == 0
    assert first_row(serve(scheduler, request("d", PROMPT, salt="tenant-1")), "d")[0] == 12


def test_another_tenant_gets_no_hit_whatever_salt_it_picks():
    scheduler = make_scheduler()
    serve(scheduler, replace(request("a", PROMPT), cache_tenant="team-a"))
    assert first_row(serve(scheduler, replace(request("b", PROMPT), cache_tenant="team-b")), "b")[0] == 0
    assert first_row(serve(scheduler, request("c", PROMPT)), "c")[0] == 0  # the shared namespace is another one
    assert first_row(serve(scheduler, replace(request("d", PROMPT), cache_tenant="team-a")), "d")[0] == 12
    # The tenant keys the hash: no (salt, tenant) pair of another tenant reaches team-a's root.
    roots = {cache_namespace("model", salt, tenant) for salt in ("", "team-a", "\0team-a") for tenant in ("", "team-a", "team-b")}
    assert len(roots) == 9
    assert cache_namespace("model", "s", "") == hashlib.blake2b(b"model\0s", digest_size=16).digest()  # unkeyed: as before


def test_caching_off_never_hits():
    scheduler = make_scheduler(enable_prefix_caching=False)
    serve(scheduler, request("a", PROMPT))
    assert first_row(serve(scheduler, request("b", PROMPT)), "b")[0] == 0
    assert scheduler.block_manager.cache.num_cached == 0


def test_block_is_shared_only_after_the_step_that_wrote_it_is_published():
    scheduler = make_scheduler(max_step_tokens=64)
    scheduler.add_request(request("a", PROMPT))
    step_a = scheduler.schedule()  # a's prompt in flight, not published
    scheduler.add_request(request("b", PROMPT))
    step_b = scheduler.schedule()
    assert first_row([step_b], "b")[0] == 0  # nothing shareable yet
    reclaim = FakeReclaim()
    reclaim.publish(scheduler, step_a)
    reclaim.publish(scheduler, step_b)
    run_pipeline(scheduler, reclaim)
    assert scheduler.block_manager.cache.num_cached == 3  # b wrote the same prefix again: not added twice
    assert_idle_pool_exact(scheduler)


def test_failed_step_blocks_are_never_served():
    scheduler = make_scheduler()
    scheduler.add_request(request("a", PROMPT))
    step = scheduler.schedule()
    scheduler.update_from_output(reclaim_pb2.StepEvents(step_id=step.step_id, error_code=13, error_message="boom"))
    assert scheduler.block_manager.cache.num_cached == 0
    assert first_row(serve(scheduler, request("b", PROMPT)), "b")[0] == 0
    assert_idle_pool_exact(scheduler)


def test_refused_step_blocks_are_never_served_even_after_a_later_step_publishes():
    scheduler = make_scheduler(max_prefill_chunk=8)
    scheduler.add_request(request("a", PROMPT))
    refused, later = scheduler.schedule(), scheduler.schedule()  # a's prompt in two chunks
    assert scheduler.fail_step(refused.step_id) == [refused.rows[0].request]
    FakeReclaim().publish(scheduler, later)  # the later chunk ran; its blocks' start did not
    assert scheduler.block_manager.cache.num_cached == 0
    run_pipeline(scheduler, FakeReclaim())
    assert_idle_pool_exact(scheduler)


def test_error_event_of_a_sequence_keeps_its_blocks_out():
    scheduler = make_scheduler(max_step_tokens=64, max_prefill_chunk=64)
    scheduler.add_request(request("a", PROMPT))
    step = scheduler.schedule()
    seq = step.rows[0]
    bad = reclaim_pb2.SequenceEvent(request_id="a", seq_index=seq.seq_index, generation=seq.generation, error_code=13)
    scheduler.update_from_output(reclaim_pb2.StepEvents(step_id=step.step_id, events=[bad]))
    assert scheduler.block_manager.cache.num_cached == 0


def test_eviction_takes_only_unreferenced_blocks_least_recently_used_first():
    scheduler = make_scheduler(kv_num_blocks=8, max_step_tokens=64, max_prefill_chunk=64)
    serve(scheduler, request("a", [1] * 8, max_tokens=1))       # caches a's 2 blocks
    serve(scheduler, request("b", [2] * 8, max_tokens=1))       # then b's 2
    blocks = scheduler.block_manager
    assert blocks.cache.num_evictable == 4 and blocks.num_available == 8
    scheduler.add_request(request("hold", [3] * 9, max_tokens=1))  # 3 blocks from the free list
    hold_step = scheduler.schedule()
    scheduler.add_request(request("c", [4] * 12, max_tokens=1))    # needs 3: 1 free + 2 evicted
    c_step = scheduler.schedule()
    assert blocks.cache.num_evictions == 2
    assert blocks.cache.longest_prefix(chain_hashes([1] * 8, BLOCK, cache_namespace(scheduler.config.model_identity))) == []
    assert len(blocks.cache.longest_prefix(chain_hashes([2] * 8, BLOCK, cache_namespace(scheduler.config.model_identity)))) == 2
    held = set(hold_step.new_block_ids)
    assert held.isdisjoint(c_step.new_block_ids)  # a held block is never taken
    reclaim = FakeReclaim()
    reclaim.publish(scheduler, hold_step)
    reclaim.publish(scheduler, c_step)
    run_pipeline(scheduler, reclaim)
    assert_idle_pool_exact(scheduler)


def test_hit_on_evictable_blocks_counts_them_against_admission():
    scheduler = make_scheduler(kv_num_blocks=6, max_step_tokens=64, max_prefill_chunk=64)
    serve(scheduler, request("a", [1] * 13, max_tokens=1))  # 3 cached blocks (evictable), 4 blocks in all
    blocks = scheduler.block_manager
    assert blocks.can_allocate(24 - 1, blocks.cache.longest_prefix(scheduler.block_hashes(request("x", [1] * 24))[:3]))
    scheduler.add_request(request("b", [1] * 13 + [5] * 10, max_tokens=1))  # hit 3, writes 3 more: takes all 6
    step = scheduler.schedule()
    assert first_row([step], "b")[0] == 12 and blocks.num_available == 0
    scheduler.add_request(request("c", [9] * 3, max_tokens=1))
    assert scheduler.schedule() is None  # must wait: no block to reserve
    finish(scheduler, step)
    assert_idle_pool_exact(scheduler)


def finish(scheduler: Scheduler, *steps: ScheduledStep) -> FakeReclaim:
    """Publish ``steps`` (already scheduled), then run everything to its end."""
    reclaim = FakeReclaim()
    for step in steps:
        reclaim.publish(scheduler, step)
    run_pipeline(scheduler, reclaim)
    return reclaim


def test_abort_while_waiting_takes_no_reference():
    scheduler = make_scheduler(max_num_seqs=1)
    serve(scheduler, request("a", PROMPT))
    scheduler.add_request(request("busy", [50] * 8, max_tokens=4))
    busy = scheduler.schedule()
    scheduler.add_request(request("b", PROMPT))
    assert scheduler.abort(next(iter(scheduler._waiting))) is AbortOutcome.REMOVED_WAITING
    finish(scheduler, busy)
    assert_idle_pool_exact(scheduler)


def test_abort_mid_prefill_with_shared_blocks_keeps_refcounts_exact():
    scheduler = make_scheduler(max_prefill_chunk=4, max_step_tokens=8)
    long_prompt = list(range(1, 30))
    serve(scheduler, request("a", long_prompt))
    scheduler.add_request(request("b", long_prompt[:24] + [7] * 12))
    scheduler.add_request(request("c", long_prompt[:24] + [8] * 12))
    step = scheduler.schedule()  # both start at 24 with 6 shared blocks
    shared = step.rows[0].blocks.block_ids[:6]
    assert all(scheduler.block_manager.ref_count(b) == 2 for b in shared)
    scheduler.abort(step.rows[0].request)
    reclaim = finish(scheduler, step)
    assert reclaim.finished["b"] != reclaim.finished["c"]  # b aborted, c ran to its length
    assert_idle_pool_exact(scheduler)


def test_abort_while_decoding_keeps_refcounts_exact():
    scheduler = make_scheduler()
    serve(scheduler, request("a", PROMPT))
    scheduler.add_request(request("b", PROMPT, max_tokens=20))
    reclaim = FakeReclaim()
    steps = [scheduler.schedule() for _ in range(3)]
    for step in steps:
        reclaim.publish(scheduler, step)
    scheduler.abort(steps[0].rows[0].request)
    run_pipeline(scheduler, reclaim)
    assert reclaim.finished["b"] != 0
    assert_idle_pool_exact(scheduler)


def test_thousand_random_requests_and_cancels_end_with_every_block_free_or_cached():
    rng = random.Random(14)
    scheduler = make_scheduler(max_num_seqs=6, kv_num_blocks=40, max_step_tokens=24, max_prefill_chunk=8, max_waiting=1000)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 20))] for _ in range(8)]
    reclaim, in_flight, live = FakeReclaim(), [], []
    for n in range(1000):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 20)] + [rng.randrange(1000) for _ in range(rng.randrange(0, 6))]
        r = request(f"r{n}", prompt, max_tokens=rng.randrange(1, 6), salt=rng.choice(["", "", "s"]))
        scheduler.add_request(r)
        live.append(r)
        for _ in range(rng.randrange(0, 3)):
            if rng.random() < 0.2 and live:
                scheduler.abort(live.pop(rng.randrange(len(live))))
            step = scheduler.schedule() if len(in_flight) < 2 else None
            if step is not None:
                in_flight.append(step)
            elif in_flight:
                finished = in_flight.pop(0)
                if rng.random() < 0.02:
                    scheduler.update_from_output(reclaim_pb2.StepEvents(step_id=finished.step_id, error_code=13))
                    for seq in finished.rows:
                        reclaim.live.pop(seq.request.request_id, None)
                else:
                    reclaim.publish(scheduler, finished)
    for step in in_flight:
        reclaim.publish(scheduler, step)
    run_pipeline(scheduler, reclaim, max_steps=100_000)
    assert scheduler.num_running == scheduler.num_waiting == 0
    assert scheduler.block_manager.cache.num_cached > 0
    assert_idle_pool_exact(scheduler)


def _load(running: int = 0, waiting: int = 0, available: int = 100) -> DeviceLoad:
    return DeviceLoad(device_pb2.AttachReply(), running, waiting, available, 100, available)


def test_placement_weighs_the_cached_prefix_against_load():
    assert placement_order([_load(), _load()], [0, 32]) == [1, 0]  # equal loads: the hit decides
    assert placement_order([_load(), _load(running=1)], [0, 32]) == [0, 1]  # a short hit does not outweigh a request
    assert placement_order([_load(), _load(running=3), _load(running=1)], [0, 1500, 0]) == [1, 0, 2]  # a long one does
    assert placement_order([_load(), _load(running=9)], [0, 1500]) == [0, 1]  # too busy: load wins
    assert placement_order([_load(), _load(available=0)], [0, 1500]) == [0, 1]  # no KV headroom
    assert placement_order([_load(running=1), _load()], [0, 0]) == [1, 0]
