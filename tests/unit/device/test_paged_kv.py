"""Paged KV cache: mixed batches over scattered blocks compute exactly what each row computes alone."""

from __future__ import annotations

import os

import pytest
import torch

from stageserve.device.model.kv_cache import PagedKVCache, bytes_per_block, kv_memory_budget, num_blocks_for_memory, zeroed_pool
from stageserve.device.model.forward_batch import build_forward_batch
from stageserve.device.model.decoder import DecoderModel
from stageserve.model_files import embedded_model_path

BLOCK_SIZE = 4
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model() -> DecoderModel:
    return DecoderModel.from_path(embedded_model_path(), torch.float32, "cpu")


def _blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def _run_alone(model: DecoderModel, history: list[int], new: list[int]) -> torch.Tensor:
    """Logits [vocab] of ``new`` after ``history`` for one row in a fresh cache with contiguous blocks."""
    cache = PagedKVCache(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    table = list(range(_blocks_for(len(history) + len(new))))
    if history:
        model.forward(build_forward_batch([(history, 0, table, False)], BLOCK_SIZE, "cpu"), cache)
    return model.forward(build_forward_batch([(new, len(history), table, True)], BLOCK_SIZE, "cpu"), cache)[0]


def test_mixed_batch_over_scattered_blocks_matches_rows_alone(model):
    """Decode rows of different lengths, a fresh prefill and a later prefill chunk, sharing one step,
    with block tables drawn from a shuffled pool whose unowned blocks hold garbage, give each row the
    logits it gets when run alone (< 1e-4): rows read only their own blocks, masks and padding are right."""
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, 49152, (n,), generator=g).tolist()  # noqa: E731
    # (history already cached, new tokens this step, sample?)
    rows = [
        (rand(30), rand(1), True),   # decode, long context
        ([], rand(11), True),        # fresh prefill
        (rand(5), rand(1), True),    # decode, short context, ends mid-block
        (rand(17), rand(9), True),   # chunked prefill continuation
        (rand(8), rand(1), False),   # decode row that does not sample
        (rand(2), rand(1), True),    # decode, context inside one block
    ]
    cache = PagedKVCache(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    cache.kv.normal_(0.0, 50.0, generator=g)  # stale finite data everywhere; read unmasked it would show
    pool = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables = []
    for history, new, _ in rows:
        tables.append([pool.pop() for _ in range(_blocks_for(len(history) + len(new)))])
        if history:
            model.forward(build_forward_batch([(history, 0, tables[-1], False)], BLOCK_SIZE, "cpu"), cache)
    step = [(new, len(history), table, sample) for (history, new, sample), table in zip(rows, tables)]
    logits = model.forward(build_forward_batch(step, BLOCK_SIZE, "cpu"), cache)

    expected = torch.stack([_run_alone(model, history, new) for history, new, sample in rows if sample])
    assert logits.shape == (5, model.config.vocab_size)
    assert (logits - expected).abs().max() < 1e-4


def test_forward_batch_orders_decode_rows_first_and_keeps_sample_order():
    """Decode tokens come first in the flat batch; sample_indices still follow the caller's row order;
    slots and positions follow the block tables."""
    batch = build_forward_batch([([7, 8, 9], 2, [5, 1], True), ([4], 5, [3, 6], True)], BLOCK_SIZE, "cpu")
    assert batch.num_decode == 1
    assert batch.input_ids.tolist() == [4, 7, 8, 9]
    assert batch.positions.tolist() == [5, 2, 3, 4]
    assert batch.slot_mapping.tolist() == [6 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 1 * 4 + 0]
    assert batch.sample_indices.tolist() == [3, 0]
    assert batch.decode_blocks.tolist() == [[3, 6]]
    assert batch.decode_mask.tolist() == [[True] * 6 + [False] * 2]
    assert batch.prefills[0].mask.tolist()[0] == [True, True, True, False, False]
    with pytest.raises(ValueError, match="cannot hold"):
        build_forward_batch([([1, 2], 7, [0, 1], True)], BLOCK_SIZE, "cpu")


def test_sizing_helpers(model):
    """Block bytes count K and V over all layers; the block count floors; the CPU budget is a
    positive share of physical memory."""
    per_block = bytes_per_block(model.config, 16, torch.bfloat16)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 2
    assert num_blocks_for_memory(model.config, 16, torch.bfloat16, 10 * per_block + per_block - 1) == 10
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < kv_memory_budget("cpu", 0.5) <= physical // 2
    with pytest.raises(ValueError):
        kv_memory_budget("cpu", 0.0)


def test_the_cpu_pool_is_zeros_from_a_memory_map_that_the_tensor_keeps_alive():
    """`zeroed_pool` on the CPU: every value 0 of the dtype asked for, writable, and still readable
    once nothing but the tensor refers to its map (the map is the tensor's buffer)."""
    import gc

    pool = zeroed_pool((3, 2, 5, 4, 8), torch.bfloat16, torch.device("cpu"))
    gc.collect()
    assert (pool.shape, pool.dtype, pool.is_contiguous()) == ((3, 2, 5, 4, 8), torch.bfloat16, True)
    assert torch.count_nonzero(pool) == 0
    pool[1, 0, 2].fill_(1.5)
    assert pool.sum().item() == 1.5 * 4 * 8
    assert zeroed_pool((0, 4), torch.float32, torch.device("cpu")).shape == (0, 4)


def test_the_cpu_budget_stays_within_a_containers_memory_limit(tmp_path, monkeypatch):
    """The memory cgroup's limit less its usage bounds what the CPU offers (v2's files, then v1's);
    no limit (v2 ``max``, v1's huge number) or no files leave /proc/meminfo's figure."""
    from stageserve.device.model import kv_cache

    v2, v1 = (tmp_path / "memory.max", tmp_path / "memory.current"), (tmp_path / "limit", tmp_path / "usage")
    monkeypatch.setattr(kv_cache, "_CGROUP_FILES", (v2, v1))
    assert kv_cache._cgroup_room_bytes() is None
    v1[0].write_text(f"{2**63 - 4096}\n")
    v1[1].write_text("1000\n")
    assert kv_cache._cgroup_room_bytes() is None
    v2[0].write_text("1073741824\n")
    v2[1].write_text("73741824\n")
    assert kv_cache._cgroup_room_bytes() == 10**9
    assert kv_cache.available_memory_bytes("cpu") <= 10**9
    v2[0].write_text("max\n")
    assert kv_cache._cgroup_room_bytes() is None
