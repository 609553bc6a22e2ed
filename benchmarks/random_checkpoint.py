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
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from stageserve.model_files import embedded_model_path, transformers_source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", type=Path, default=None, help="a .gguf file or HF directory to copy config and tokenizer from (default: the embedded model)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--config-only", action="store_true", help="write config and tokenizer files, no weights")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=INT", help="config fields to change, e.g. hidden_size=960 num_hidden_layers=32 (a larger model of the same family)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.like is None:
        args.like = embedded_model_path()
    source = transformers_source(args.like)
    config = AutoConfig.from_pretrained(**source, local_files_only=True)
    for item in args.set:
        key, _, value = item.partition("=")
        setattr(config, key, int(value))
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
