"""Issue 31: the KV pool's bytes per token with multi-head latent attention against grouped-query
attention of the same width, and the longest context each fits in the same KV memory.

The pools are the device's own (`PagedKVCache`, sized by `bytes_per_block`), built for DeepSeek-V2-Lite's
attention shape (27 layers, hidden 2048, 16 heads; latent 512 + rotated key 64 per token and layer)
and for grouped-query models of the same layers and width (16 query heads of 128; 16, 8 and 4 KV
heads); the bytes are the pool tensor's own (``nbytes``) per token it holds.

    python benchmarks/mla_kv.py [--memory-gib 4]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from stageserve.device.model.config import ModelConfig
from stageserve.device.model.kv_cache import PagedKVCache

BLOCK_SIZE = 16


def shapes() -> dict[str, ModelConfig]:
    """DeepSeek-V2-Lite's attention (MLA) and grouped-query models of its layers and width."""
    base = ModelConfig(architecture="llama", vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_layers=27, num_heads=16,
                       num_kv_heads=16, head_dim=128, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=163840,
                       tie_word_embeddings=False, attention_bias=False, bos_token_id=None, eos_token_ids=(1,))
    mla = replace(base, architecture="deepseek2", head_dim=64, kv_lora_rank=512, qk_nope_head_dim=128, v_head_dim=128)
    return {"MLA (DeepSeek-V2-Lite: latent 512 + rotated key 64)": mla,
            **{f"GQA, {kv} KV heads of 128": replace(base, num_kv_heads=kv) for kv in (16, 8, 4)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-gib", type=float, default=4.0, help="the KV memory the longest context is fitted in")
    args = parser.parse_args()
    memory = int(args.memory_gib * 2**30)
    print(f"bfloat16 pools, blocks of {BLOCK_SIZE} tokens; longest context in {args.memory_gib:g} GiB of KV\n")
    print("| attention | bytes per token | x MLA's | longest context (tokens) |\n|---|---:|---:|---:|")
    per_token = {}
    for name, config in shapes().items():
        pool = PagedKVCache(config, 4, BLOCK_SIZE, torch.bfloat16, "cpu")
        per_token[name] = pool.kv.nbytes // (4 * BLOCK_SIZE)
    mla = next(iter(per_token.values()))
    for name, size in per_token.items():
        print(f"| {name} | {size:,} | {size / mla:.2f}x | {memory // size // BLOCK_SIZE * BLOCK_SIZE:,} |")


if __name__ == "__main__":
    main()
