"""A tiny randomly initialised Llama (or Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3) checkpoint with its own byte-level tokenizer, written offline.

For tests that need a whole model directory (weights, config, tokenizer) where the embedded GGUF is
not available or too slow, e.g. on an accelerator machine: ``config.json`` + ``model.safetensors``
from transformers' ``LlamaForCausalLM`` (or another family's ``*ForCausalLM``) and a byte-level BPE tokenizer
with no merges (256 byte tokens + ``<|endoftext|>``), so any text round-trips and nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

EOS = "<|endoftext|>"
VOCAB_SIZE = 257  # 256 byte tokens + EOS


def write_tiny_checkpoint(
    directory: Path, seed: int = 0, num_layers: int = 2, family: str = "llama", sliding_window: int | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Write the checkpoint into ``directory`` (created if needed); return ``directory``.

    The model: ``num_layers`` layers (weights drawn from ``seed``), hidden 64, 4 query heads over 1 KV head (GQA), tied embeddings,
    ``initializer_range`` 0.2 so logits are well separated and greedy choices are stable across
    devices in float32. ``family="qwen3"``: a Qwen3 instead, with 2 KV heads of ``head_dim`` 64
    (not hidden / heads) and its q/k norm weights drawn around 1 (transformers sets them to 1).
    ``family="mistral"``: a Mistral with Qwen3's head shape and ``sliding_window`` (``None``: full
    attention). ``family="phi3"``: a Phi-3 of hidden 128, 2 query heads of 64 over 1 KV head, RoPE on
    half of each head, ``longrope`` with random short and long factors from position 128 on.
    ``family="gemma2"``: a Gemma 2 with Qwen3's head shape, local and global layers alternating
    (window ``sliding_window``, default 8), attention scores capped at 5 and logits at 10 (so the
    caps change the result), ``query_pre_attn_scalar`` the head size (as Google's 2B/9B).
    ``family="gemma3"``: a Gemma 3 text model of 6 layers (five local, one global: its default
    pattern), local RoPE base 10000 and a global one of 10^6 with linear scaling by 2. Both draw their
    ``(1 + w)`` norm weights around 0 (transformers sets them to 0). ``family="qwen3_moe"``: Qwen3's
    layer with 8 experts of 64, top 2 renormalised, layer 0 dense (``mlp_only_layers``);
    ``family="mixtral"``: Mistral's with 8 experts of 128, top 2, in every layer; both draw their router
    weights (transformers' Qwen3-MoE leaves them 0, every expert tied). ``family="deepseek_v3"``: a
DeepSeek-V3 with latent attention (``q_lora_rank`` 32, ``kv_lora_rank`` 32, heads of 16 unrotated
and 16 rotated query/key values and 24 value ones, YaRN by 4 with ``mscale_all_dim``), layer 0
dense, then 8 routed experts of 32 in 4 groups (2 kept), top 2, sigmoid scores with a random
correction bias, 1 shared expert, weights scaled by 2.5; ``family="deepseek_v2"``: a DeepSeek-V2
with no ``q_lora_rank``, no YaRN, softmax ``group_limited_greedy`` routing and 2 shared experts.
``overrides``: further config fields.
    Head size 64 everywhere but Llama's, so the fused CPU kernels run them.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM, Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                              MistralConfig, MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Phi3Config, Phi3ForCausalLM,
                              PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    directory.mkdir(parents=True, exist_ok=True)
    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(byte_symbols))}
    vocab[EOS] = len(vocab)
    assert len(vocab) == VOCAB_SIZE
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(directory)

    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
                 max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.2,
                 bos_token_id=None, eos_token_id=vocab[EOS], pad_token_id=vocab[EOS]) | dict(overrides or {})
    if family in ("qwen3", "qwen3_moe"):
        if family == "qwen3":
            model = Qwen3ForCausalLM(Qwen3Config(num_key_value_heads=2, head_dim=64, **shape))
        else:
            model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**({"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                                            "norm_topk_prob": True, "mlp_only_layers": [0]} | shape),
                                                         num_key_value_heads=2, head_dim=64))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(num_key_value_heads=2, head_dim=64, sliding_window=sliding_window, **shape))
    elif family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**({"num_local_experts": 8, "num_experts_per_tok": 2} | shape), num_key_value_heads=2,
                                                 head_dim=64, sliding_window=sliding_window))
    elif family == "phi3":
        factors = [torch.empty(16).uniform_(1.0, 4.0).tolist() for _ in range(2)]
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": factors[0], "long_factor": factors[1]}
        model = Phi3ForCausalLM(Phi3Config(**(shape | {"hidden_size": 128, "num_attention_heads": 2}), num_key_value_heads=1,
                                           partial_rotary_factor=0.5, original_max_position_embeddings=128, rope_parameters=rope))
    elif family in ("gemma2", "gemma3"):
        gemma = dict(num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, sliding_window=sliding_window or 8) | shape
        if family == "gemma2":
            model = Gemma2ForCausalLM(Gemma2Config(**({"attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0} | gemma)))
        else:
            rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
            model = Gemma3ForCausalLM(Gemma3TextConfig(**({"rope_parameters": rope} | gemma | {"num_hidden_layers": max(num_layers, 6)})))
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if name.endswith("norm.weight"):
                    weight.normal_(0.0, 0.3)
    elif family in ("deepseek_v2", "deepseek_v3"):
        mla = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=32, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
        if family == "deepseek_v3":
            rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                    "mscale": 0.707, "mscale_all_dim": 0.707}
            model = DeepseekV3ForCausalLM(DeepseekV3Config(**(mla | {"q_lora_rank": 32, "n_shared_experts": 1, "rope_parameters": rope} | shape)))
        else:
            model = DeepseekV2ForCausalLM(DeepseekV2Config(**(mla | {"q_lora_rank": None, "n_shared_experts": 2, "norm_topk_prob": False,
                                                                  "topk_method": "group_limited_greedy", "routed_scaling_factor": 2.0} | shape)))
    else:
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=1, **shape))
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # a router
                weight.normal_(0.0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # transformers leaves it 0
                buffer.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    return directory


def add_mtp_layer(directory: Path, seed: int = 1, copy_target: bool = False) -> Path:
    """Add one multi-token-prediction layer to the DeepSeek-V3 checkpoint in ``directory`` (written by
    `write_tiny_checkpoint`), as DeepSeek stores it: ``model.layers.{num_hidden_layers}.*`` (``enorm``,
    ``hnorm``, ``eh_proj``, a decoder block, ``shared_head.norm`` / ``shared_head.head``, its own
    ``embed_tokens``) in ``model-mtp.safetensors``, and ``num_nextn_predict_layers`` 1 in
    ``config.json``. transformers' DeepseekV3 ignores these tensors on load, so they are written here.

    Random (``seed``): the block of a checkpoint with one more layer, norms drawn around 1, a random
    ``eh_proj`` and head. ``copy_target``: the module reproduces a one-layer target exactly: its
    block is the target's layer, ``eh_proj`` passes the embedding half only, ``enorm`` is 1 over
    embedding rows rescaled to RMS 1 (so ``enorm(embed(t)) = embed(t)``, the target's input), the
    shared head is the target's final norm and (tied) head; fed the token at a position, it gives
    the target's logits there.
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    weights = load_file(directory / "model.safetensors")
    own = f"model.layers.{n}."
    if copy_target:
        assert n == 1, "a copy of the target's one layer"
        embed = weights["model.embed_tokens.weight"]
        embed = embed / embed.pow(2).mean(dim=1, keepdim=True).sqrt()
        weights["model.embed_tokens.weight"] = embed
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
        block = {own + name.removeprefix("model.layers.0."): t for name, t in weights.items() if name.startswith("model.layers.0.")}
        mtp = {own + "enorm.weight": torch.ones(hidden), own + "hnorm.weight": torch.ones(hidden),
               own + "eh_proj.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1),
               own + "shared_head.norm.weight": weights["model.norm.weight"], own + "shared_head.head.weight": embed,
               own + "embed_tokens.weight": embed}
    else:
        donor = write_tiny_checkpoint(directory / "mtp-donor", seed=seed, num_layers=n + 1, family=config["model_type"],
                                      overrides={"first_k_dense_replace": config["first_k_dense_replace"]})
        block = {name: t for name, t in load_file(donor / "model.safetensors").items() if name.startswith(own)}
        generator = torch.Generator().manual_seed(seed)

        def around_one() -> torch.Tensor:
            return 1.0 + 0.2 * torch.randn(hidden, generator=generator)

        mtp = {own + "enorm.weight": around_one(), own + "hnorm.weight": around_one(),
               own + "eh_proj.weight": 0.2 * torch.randn(hidden, 2 * hidden, generator=generator),
               own + "shared_head.norm.weight": around_one(), own + "shared_head.head.weight": 0.2 * torch.randn(config["vocab_size"], hidden, generator=generator),
               own + "embed_tokens.weight": weights["model.embed_tokens.weight"]}
        shutil.rmtree(donor)
    save_file({name: t.clone().contiguous() for name, t in (block | mtp).items()}, directory / "model-mtp.safetensors", metadata={"format": "pt"})
    config_file.write_text(json.dumps(config | {"num_nextn_predict_layers": 1}, indent=2))
    return directory


THINK_TOKENS = ("<think>", "</think>")


def write_scripted_checkpoint(directory: Path, script: list[str], seed: int = 0) -> Path:
    """Write a tiny Llama whose greedy answer to any chat is ``script``'s tokens, then EOS.

    ``script``: distinct tokens, each a byte or one of ``THINK_TOKENS`` (added to the byte-level
    tokenizer as Qwen3 adds them: not special, so they decode as text). The chat template renders the
    messages' contents and, as its generation prompt, ``":"``. The model is a bigram table: every
    layer's output projections are zero (the layers add nothing to the residual), so the logits
    depend on the last token only, and the untied LM head makes each of ``":"`` and the script's
    tokens predict the next one. For what a real model cannot be relied on to write (reasoning tags).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(byte_symbols))}
    vocab[EOS] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in THINK_TOKENS])
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}:{% endif %}"
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS, chat_template=template)
    fast.save_pretrained(directory)

    ids = [fast.convert_tokens_to_ids(t) if t in THINK_TOKENS else fast.encode(t)[0] for t in [":", *script]] + [vocab[EOS]]
    assert len(set(ids)) == len(ids), "the script's tokens must be distinct (a bigram table)"
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=vocab[EOS], pad_token_id=vocab[EOS])
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = torch.nn.functional.normalize(torch.randn(config.vocab_size, config.hidden_size), dim=-1)
        model.model.embed_tokens.weight.copy_(embed)
        model.lm_head.weight.zero_()
        for current, following in zip(ids, ids[1:]):
            model.lm_head.weight[following] += 50.0 * embed[current]
    model.save_pretrained(directory)
    return directory
