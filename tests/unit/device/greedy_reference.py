"""A model's greedy continuation decoded one token at a time: the reference the speculative proposers'
drafts are checked against (test_draft_model, test_mtp)."""

from __future__ import annotations

import torch

from stageserve.device.model.decoder import DecoderModel
from stageserve.device.model.forward_batch import build_forward_batch
from stageserve.device.model.kv_cache import PagedKVCache

CPU = torch.device("cpu")
BLOCK_SIZE, NUM_BLOCKS = 4, 8
TABLE = list(range(NUM_BLOCKS))


def greedy_continuation(model: DecoderModel, prompt: list[int], count: int) -> list[int]:
    """The model's ``count`` greedy tokens after ``prompt``, decoded one at a time over a float32 KV
    pool of its own (``NUM_BLOCKS`` blocks of ``BLOCK_SIZE``: ``prompt`` + ``count`` fit in them)."""
    kv = PagedKVCache(model.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, CPU)
    logits = model.forward(build_forward_batch([(prompt, 0, TABLE, True)], BLOCK_SIZE, CPU), kv)
    tokens: list[int] = []
    for _ in range(count):
        tokens.append(int(logits.argmax()))
        logits = model.forward(build_forward_batch([([tokens[-1]], len(prompt) + len(tokens) - 1, TABLE, True)], BLOCK_SIZE, CPU), kv)
    return tokens
