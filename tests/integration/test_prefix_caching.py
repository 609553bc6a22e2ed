"""Prefix caching end to end: the shared pipeline (caching on, the default) against one started
with ``--no-prefix-caching``, greedy in float32; the outputs must be the same tokens."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from stageserve.v1 import prepare_pb2, prepare_pb2_grpc

from .conftest import launch
from .test_generation_api import collect
from .test_observability import metric, scrape

BLOCK = 16  # the device's default --block-size
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def uncached(tmp_path_factory: pytest.TempPathFactory):
    started = launch(tmp_path_factory, "no-prefix-caching", prepare_args=["--no-prefix-caching"])
    try:
        with grpc.insecure_channel(started.prepare.address) as channel:
            yield prepare_pb2_grpc.GenerationStub(channel)
    finally:
        started.stop()


def generate(stub, ids: list[int], request_id: str, salt: str | None = None) -> tuple[list[int], int]:
    """(completion token ids, usage.cached_tokens) of a greedy request."""
    request = prepare_pb2.GenerateRequest(request_id=request_id, prompt_token_ids=ids, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    if salt is not None:
        request.cache_salt = salt
    _, tokens, chunks = collect(stub.GenerateStream(request, timeout=120))
    return tokens, chunks[-1].usage.cached_tokens


def concurrently(stub, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], int]]:
    """:func:`generate` of every prompt at once (one batch on the device), by request id."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return dict(zip(prompts, pool.map(lambda rid: generate(stub, prompts[rid], rid), prompts)))


def random_ids(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 40000) for _ in range(count)]


def test_hits_partial_hits_and_misses_give_the_tokens_of_caching_off(pipeline, generation, uncached):
    base = random_ids(1, 100)  # 6 full blocks and 4 tokens
    cases = {
        "prime": base,
        "hit": base + random_ids(2, 7),                  # 6 blocks from the cache
        "partial": base[:40] + random_ids(3, 30),        # 2 blocks from the cache
        "equal": base,                                   # 6 blocks; the last 4 tokens computed
        "multiple": base[:64],                           # 4 blocks exactly: 3 from the cache, the 4th recomputed
        "miss": random_ids(4, 50),
    }
    expected = {rid: generate(uncached, ids, f"off-{rid}") for rid, ids in cases.items()}
    assert all(cached == 0 for _, cached in expected.values())
    prime = generate(generation, cases["prime"], "on-prime")
    assert prime == (expected["prime"][0], 0)
    before = scrape(pipeline.prepare)
    rest = concurrently(generation, {rid: ids for rid, ids in cases.items() if rid != "prime"})  # one batch mixing them
    cached = {rid: cached for rid, (_, cached) in rest.items()}
    assert cached == {"hit": 96, "partial": 32, "equal": 96, "multiple": 48, "miss": 0}
    assert {rid: tokens for rid, (tokens, _) in rest.items()} == {rid: expected[rid][0] for rid in rest}
    after = scrape(pipeline.prepare)
    for name, grown in (("stageserve_prefix_cache_queries_tokens_total", sum(len(cases[rid]) for rid in rest)),
                        ("stageserve_prefix_cache_hits_tokens_total", sum(cached.values()))):
        assert metric(after, name) - metric(before, name) == grown
    assert metric(after, "stageserve_kv_cache_blocks_cached") >= 6


def test_another_cache_salt_gets_no_hit(generation):
    ids = random_ids(5, 70)
    first, cached = generate(generation, ids, "salt-a1", salt="tenant-a")
    assert cached == 0
    assert generate(generation, ids, "salt-b", salt="tenant-b") == (first, 0)
    assert generate(generation, ids, "salt-none") == (first, 0)
    assert generate(generation, ids, "salt-a2", salt="tenant-a") == (first, 64)


def test_model_info_shows_cached_blocks_per_device(generation):
    generate(generation, random_ids(6, 40), "info")
    info = generation.GetModelInfo(prepare_pb2.GetModelInfoRequest())
    assert len(info.devices) == 1 and info.devices[0].kv_blocks_cached >= 2
    assert info.kv_blocks_free == info.kv_blocks_total  # cached blocks nobody holds count as free
