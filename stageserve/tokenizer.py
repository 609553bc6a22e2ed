"""Tokenizer and chat template loading, shared by prepare (tokenize, chat template) and reclaim
(detokenize).

Uses the Hugging Face ``transformers`` tokenizer for both model formats: for a GGUF file it is
built from the file's embedded vocabulary and chat template (``gguf_file=``); for a Hugging Face
directory from its tokenizer files. Nothing is downloaded (``local_files_only``).
"""

from __future__ import annotations

import os
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from stageserve.model_files import transformers_source


def load_tokenizer(model_path: Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a GGUF file or a Hugging Face model directory.

    Args:
        model_path: a ``.gguf`` file, or a directory with ``tokenizer.json``/``tokenizer_config.json``.

    Raises:
        ValueError: the path holds no tokenizer transformers can read; the message names the path.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return AutoTokenizer.from_pretrained(**transformers_source(model_path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot load a tokenizer from {model_path}: {exc}") from exc
