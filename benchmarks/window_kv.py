"""KV memory a 4,096-token sequence holds on windowed models, with the sliding window's block
release and without it (``kv_window`` 0, what a model with a global layer gets).

Prepare's real scheduler and block manager run the sequence (a 2,048-token prompt in chunks of
512, then 2,048 greedy decode steps, two steps in flight, blocks of 16 tokens), each plan admitted
by the device's sequence table, every row checked never to read a released block
(``tests/unit/prepare/test_sliding_window.WindowedPipeline``); no model runs. Memory is the peak of
the blocks the sequence held at once, times the bytes a block takes in bfloat16 for the model's
layers (``kv_cache.bytes_per_block``). For a model whose local layers sit beside global ones, the
last column is what a pool per layer group would hold (the local layers' blocks for the window,
the global layers' for every token); stageserve's one pool releases nothing there.

The second table is admission: 16 such sequences queued against a pool of 1,024 blocks, the blocks
prepare reserves for each (its whole length, or on a fully windowed model the most it can hold at
once, when fewer), how many the first step admits, and, all run to their end, the most running at
once and the most blocks one held.

    python benchmarks/window_kv.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test suite's pipeline driver
from tests.unit.prepare.test_scheduler import make_request, make_scheduler  # noqa: E402
from tests.unit.prepare.test_sliding_window import WindowedPipeline  # noqa: E402

from stageserve.device.model.config import ModelConfig  # noqa: E402
from stageserve.device.model.kv_cache import bytes_per_block  # noqa: E402

PROMPT, GENERATED, BLOCK, CHUNK = 2048, 2049, 16, 512  # 4,096 positions written
POOL, QUEUED = 1024, 16  # the admission table's pool (blocks) and requests
# (name, layers, KV heads, head_dim, sliding_window, local layers): the models' Hugging Face config.json
MODELS = (
    ("Phi-3-mini-4k-instruct", 32, 32, 96, 2047, 32),
    ("Mistral-7B-v0.1", 32, 8, 128, 4096, 32),
    ("gemma-3-1b-it (5 local : 1 global)", 26, 1, 256, 512, 22),
    ("gemma-2-2b-it (1 local : 1 global)", 26, 4, 256, 4096, 13),
)


def peak_blocks(window: int) -> int:
    """The most blocks the 4,096-token sequence holds at once with ``kv_window`` = ``window``."""
    scheduler = make_scheduler(max_num_seqs=1, max_step_tokens=CHUNK, kv_num_blocks=PROMPT + GENERATED, kv_block_size=BLOCK,
                               max_prefill_chunk=CHUNK, kv_window=window, enable_prefix_caching=False)
    scheduler.add_request(make_request("a", prompt_tokens=PROMPT, max_tokens=GENERATED))
    pipeline = WindowedPipeline(scheduler)
    pipeline.run(max_steps=10 * (PROMPT + GENERATED))
    return pipeline.peak_held["a"]


def admission(window: int) -> tuple[int, int, int, int]:
    """``QUEUED`` of the 4,096-position sequences against a pool of ``POOL`` blocks with
    ``kv_window`` = ``window``: (blocks each reserves, sequences the first step admits, most running
    at once, most blocks one held), all run to their end."""
    scheduler = make_scheduler(max_num_seqs=QUEUED, max_step_tokens=QUEUED * CHUNK, kv_num_blocks=POOL, kv_block_size=BLOCK,
                               max_prefill_chunk=CHUNK, max_waiting=QUEUED, kv_window=window, enable_prefix_caching=False)
    for i in range(QUEUED):
        scheduler.add_request(make_request(f"r{i}", prompt_tokens=PROMPT, max_tokens=GENERATED))
    reserved = scheduler.num_waiting_kv_blocks // QUEUED
    pipeline = WindowedPipeline(scheduler)
    first = len(pipeline.schedule().started)
    pipeline.run(max_steps=10 * QUEUED * (PROMPT + GENERATED))
    assert set(pipeline.produced.values()) == {GENERATED} and len(pipeline.produced) == QUEUED
    return reserved, first, pipeline.most_running, max(pipeline.peak_held.values())


def block_bytes(layers: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one block of ``BLOCK`` tokens over ``layers`` layers in bfloat16."""
    config = ModelConfig(architecture="", vocab_size=1, hidden_size=kv_heads * head_dim, intermediate_size=1, num_layers=layers,
                         num_heads=kv_heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e4,
                         max_position_embeddings=1, tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_ids=())
    return bytes_per_block(config, BLOCK, torch.bfloat16)


def main() -> None:
    full = peak_blocks(0)
    print(f"{PROMPT + GENERATED - 1} positions, blocks of {BLOCK} tokens, bfloat16 KV")
    print("| model | window | KV per block (MiB) | blocks held, released | MiB | blocks held, not released | MiB | a pool per layer group (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, layers, kv_heads, head_dim, window, local in MODELS:
        per_block = block_bytes(layers, kv_heads, head_dim) / 2**20
        windowed = peak_blocks(window)
        if local == layers:
            print(f"| {name} | {window} | {per_block:.3f} | {windowed} | {windowed * per_block:.1f} | {full} | {full * per_block:.1f} | |")
        else:
            grouped = (local * windowed + (layers - local) * full) * per_block / layers
            print(f"| {name} | {window} | {per_block:.3f} | {full} | {full * per_block:.1f} | {full} | {full * per_block:.1f} | {grouped:.1f} |")
    print()
    print(f"Admission: {QUEUED} such sequences queued against a pool of {POOL} blocks ({POOL * BLOCK} tokens), all run to their end")
    print("| model | window | blocks reserved per sequence | admitted by the first step | running at once, at most | blocks one held, at most |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, layers, _, _, window, local in MODELS:
        if local == layers:
            print(f"| {name} | {window} | " + " | ".join(map(str, admission(window))) + " |")
    print("| a model with a global layer (kv_window 0) | | " + " | ".join(map(str, admission(0))) + " |")


if __name__ == "__main__":
    main()
