"""Write a randomly initialised Hugging Face checkpoint shaped like a given model, with its tokenizer.

For speed measurements on a machine the real weights cannot be copied to (no network, little room
for files; the embedded GGUF is 92 MB): a step's time depends on the shapes, not on the weight
values, so a random checkpoint of the same config times the same. Greedy text from it is
meaningless; benchmarks use ``ignore_eos`` with a fixed output length.

Usage::

    # here: config + tokenizer of the embedded model, no weights (a few MB)
    python benchmarks/random_checkpoint.py --out shape-dir --config-only
    # there: add random weights (bfloat16 safetensors)
    python benchmarks/random_checkpoint.py --like shape-dir --out model-dir
    # a larger model of the same family (SmolLM2-360M's shape)
    python benchmarks/random_checkpoint.py --out big-dir --set hidden_size=960 intermediate_size=2560 num_hidden_layers=32 num_attention_heads=15 num_key_value_heads=5
    # another family of the same shape and tokenizer (a Qwen3 of SmolLM2-135M's size)
    python benchmarks/random_checkpoint.py --out qwen3-dir --model-type qwen3

With ``--model-type`` the config is that family's transformers default with the source's shape
(sizes, heads, vocabulary, context, special token ids, tied embeddings) copied over, then ``--set``:
the tokenizer stays the source's, so llama.cpp's ``convert_hf_to_gguf.py`` knows it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from stageserve.model_files import embedded_model_path, transformers_source

# What a --model-type config takes over from the source's config: its shape, vocabulary and special tokens.
_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
                 "bos_token_id", "eos_token_id", "pad_token_id")


def parse_value(text: str) -> int | float | bool:
    """A ``--set`` value: an int, a float, or ``true``/``false``."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return float(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", type=Path, default=None, help="a .gguf file or HF directory to copy config and tokenizer from (default: the embedded model)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--config-only", action="store_true", help="write config and tokenizer files, no weights")
    parser.add_argument("--model-type", default=None, help="a transformers model_type (qwen3, qwen3_moe, mistral, ...) to write instead of the source's family, with its shape")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config fields to change (int, float or true/false), e.g. hidden_size=960 num_hidden_layers=32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.like is None:
        args.like = embedded_model_path()
    source = transformers_source(args.like)
    config = AutoConfig.from_pretrained(**source, local_files_only=True)
    changes = {key: parse_value(value) for key, _, value in (item.partition("=") for item in args.set)}
    if args.model_type is not None:
        # Built with every field at once, so fields derived in the config's constructor (layer_types) follow.
        shape = {key: getattr(config, key) for key in _SHAPE_FIELDS if hasattr(config, key)}
        config = AutoConfig.for_model(args.model_type, **(shape | changes))
    for key, value in changes.items():
        setattr(config, key, value)
    AutoTokenizer.from_pretrained(**source, local_files_only=True).save_pretrained(args.out)
    if args.config_only:
        config.save_pretrained(args.out)
        return
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, random, bfloat16")


if __name__ == "__main__":
    main()
