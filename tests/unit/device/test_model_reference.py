"""The device model computes what Hugging Face transformers computes, for the embedded GGUF and tiny HF checkpoints."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.forward_batch import build_forward_batch
from stageserve.device.model.decoder import DecoderModel
from stageserve.model_files import embedded_model_path

BLOCK_SIZE = 16
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


def greedy(model: DecoderModel, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding through our model: prefill once, then one decode step per token.

    Returns the generated ids and each step's logits ``[new_tokens, vocab]`` float32.
    """
    blocks = -(-(len(prompt) + new_tokens) // BLOCK_SIZE)
    cache = PagedKVCache(model.config, blocks + 3, BLOCK_SIZE, model.dtype, "cpu")
    table = list(range(blocks + 2, 2, -1))[:blocks]  # deliberately reversed, non-zero block ids
    logits = [model.forward(build_forward_batch([(prompt, 0, table, True)], BLOCK_SIZE, "cpu"), cache)[0]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(new_tokens - 1):
        step = build_forward_batch([([tokens[-1]], len(prompt) + len(tokens) - 1, table, True)], BLOCK_SIZE, "cpu")
        logits.append(model.forward(step, cache)[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


def decode_run(model: DecoderModel, prompts: list[list[int]], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt prefilled alone, then ``steps`` greedy decode steps of all rows together: the
    steps' logits ``[steps, rows, vocab]`` and the KV pool after them (each row's blocks out of order)."""
    blocks = -(-(max(map(len, prompts)) + steps) // BLOCK_SIZE)
    cache = PagedKVCache(model.config, blocks * len(prompts), BLOCK_SIZE, model.dtype, "cpu")
    tables = [list(range(blocks * r, blocks * (r + 1)))[::-1] for r in range(len(prompts))]
    tokens = [int(model.forward(build_forward_batch([(p, 0, t, True)], BLOCK_SIZE, "cpu"), cache).argmax(-1)) for p, t in zip(prompts, tables)]
    logits = []
    for step in range(steps):
        rows = [([token], len(prompt) + step, table, True) for token, prompt, table in zip(tokens, prompts, tables)]
        logits.append(model.forward(build_forward_batch(rows, BLOCK_SIZE, "cpu"), cache))
        tokens = logits[-1].argmax(-1).tolist()
    return torch.stack(logits), cache.kv


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ``generate``: generated ids and raw per-step logits ``[new_tokens, vocab]``.

    EOS is switched off (not suppressed, which would change the argmax) so it runs ``new_tokens`` steps.
    """
    hf.generation_config.eos_token_id = None
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=new_tokens, do_sample=False,
                      output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


@pytest.fixture(scope="module")
def embedded_runs():
    """32 greedy tokens and per-step logits from both implementations of the embedded model (float32)."""
    torch.manual_seed(0)
    path = embedded_model_path()
    ours = DecoderModel.from_path(path, torch.float32, "cpu")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return greedy(ours, PROMPT, 32), hf_greedy(hf, PROMPT, 32)


def test_embedded_prefill_and_decode_logits_match_transformers(embedded_runs):
    """Prefill logits and 16 decode steps' logits of the embedded GGUF match transformers' within 1e-3
    (same GGUF, same float32 dequantization: checks Q/K un-permutation, RoPE, GQA, norms, tied head)."""
    (_, ours), (_, ref) = embedded_runs
    diff = (ours[:17] - ref[:17]).abs().amax(dim=1)  # step 0 is the prefill, 1..16 decode
    assert diff.max() < 1e-3, diff


def test_embedded_greedy_continuation_is_identical(embedded_runs):
    """The 32-token greedy continuation equals transformers' greedy generate, token for token."""
    (ours, _), (ref, _) = embedded_runs
    assert ours == ref


def _tiny_qwen2() -> torch.nn.Module:
    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2)
    return Qwen2ForCausalLM(config)


def _tiny_llama(rope: dict) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.2,
                         rope_parameters={"rope_theta": 10000.0, **rope})
    return LlamaForCausalLM(config)


TINY_MODELS = {
    "qwen2-bias-untied-gqa": _tiny_qwen2,
    "llama-llama3-scaling": lambda: _tiny_llama({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama-linear-scaling": lambda: _tiny_llama({"rope_type": "linear", "factor": 4.0}),
    "llama-yarn-scaling": lambda: _tiny_llama({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
}


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_hf_checkpoint_matches_transformers(tmp_path, name):
    """A randomly initialised tiny checkpoint saved as config.json + safetensors gives the same
    prefill/decode logits (< 1e-3) and the same 24-token greedy continuation as transformers.
    Covers Qwen2 q/k/v biases (set non-zero), untied lm_head, GQA, and llama3/linear/yarn RoPE."""
    torch.manual_seed(0)
    hf = TINY_MODELS[name]().eval()
    with torch.no_grad():
        for layer in hf.model.layers:  # HF initialises biases to zero, which would hide a bias bug
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                if proj.bias is not None:
                    proj.bias.normal_(0.0, 0.5)
    hf.save_pretrained(tmp_path)
    ours = DecoderModel.from_path(tmp_path, torch.float32, "cpu")
    assert ours.config.attention_bias == (name.startswith("qwen2"))
    prompt = torch.randint(3, 256, (40,)).tolist()
    (tokens, logits), (ref_tokens, ref_logits) = greedy(ours, prompt, 24), hf_greedy(hf, prompt, 24)
    assert (logits - ref_logits).abs().max() < 1e-3
    assert tokens == ref_tokens
