"""Tokenizer and chat template loading, shared by prepare (tokenize, chat template) and reclaim
(detokenize).

Uses the Hugging Face ``transformers`` tokenizer for both model formats: for a GGUF file it is
built from the file's embedded vocabulary and chat template (``gguf_file=``); for a Hugging Face
directory from its tokenizer files. Nothing is downloaded (``local_files_only``).

Building it from a GGUF file parses the file's metadata in Python (~3.5 s of CPU for the embedded
model's 49,152-token vocabulary and merges, in each of the three services at every start), so the
first load saves it in Hugging Face's format under ``$XDG_CACHE_HOME/stageserve/tokenizers/``, keyed
by the file (path, size, modification time) and the transformers version, and later loads read that
(~0.2 s). Where the cache cannot be written, every load builds from the file.

reclaim only decodes: :func:`load_fast_tokenizer` gives it the Rust ``tokenizers.Tokenizer`` of the
``tokenizer.json`` there, without transformers' tokenizer classes. prepare needs transformers' class
for the chat template; :func:`load_tokenizer` loads a tokenizers-backed class directly, instead of
through ``AutoTokenizer``, whose model-config imports take torch (about 230 MiB of a service that
never runs a tensor): a GGUF's cached tokenizer as the class ``AutoTokenizer`` built it from the file
(the plain one for Llama's, ``Qwen2Tokenizer`` for Qwen's: the cache names it), a Hugging Face folder
where it names the plain class. A folder naming a model's class goes through ``AutoTokenizer``, which
corrects some hub classes (a ``LlamaTokenizerFast`` over a byte-level ``tokenizer.json``, the
``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``): loading the named class there would tokenize wrongly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from typing import TYPE_CHECKING

import transformers  # the package alone: its tokenizer classes are imported where used (they import torch)
from tokenizers import Tokenizer

from stageserve.cache_dirs import user_cache_dir
from stageserve.model_files import transformers_source

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def load_fast_tokenizer(model_path: Path) -> Tokenizer | PreTrainedTokenizerBase:
    """The Rust tokenizer of a GGUF file or a Hugging Face model directory: its ``tokenizer.json``
    (a GGUF's: the cached one, made by :func:`load_tokenizer` first if need be); where there is none
    (a directory with only a slow tokenizer, an unwritable cache) :func:`load_tokenizer`'s.
    Raises ValueError as :func:`load_tokenizer`."""
    path = (_cache_dir(model_path) if model_path.is_file() else model_path) / "tokenizer.json"
    if not path.is_file():
        tokenizer = load_tokenizer(model_path)  # writes a GGUF's cache
        if not path.is_file():
            return tokenizer
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc


def load_tokenizer(model_path: Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a GGUF file or a Hugging Face model directory.

    Args:
        model_path: a ``.gguf`` file, or a directory with ``tokenizer.json``/``tokenizer_config.json``.

    Raises:
        ValueError: the path holds no tokenizer transformers can read; the message names the path.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cached = _cache_dir(model_path) if model_path.is_file() else None
    if cached is not None and cached.is_dir():
        try:
            return _from_folder(cached, from_cache=True)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("cached tokenizer %s unreadable (%s): building it from %s again", cached, exc, model_path)
    try:
        if model_path.is_dir():
            return _from_folder(model_path)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(**transformers_source(model_path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot load a tokenizer from {model_path}: {exc}") from exc
    if cached is not None:
        _save(tokenizer, cached)
    return tokenizer


# The class names under which transformers keeps the tokenizer wholly in tokenizer.json (one class).
_PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _from_folder(folder: Path, from_cache: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of a Hugging Face folder, or of a GGUF's cache (``from_cache``): the tokenizers-backed
    class its ``tokenizer_config.json`` names, imported alone and loaded directly, where a
    ``tokenizer.json`` is there and the class is the plain one or the folder is the cache (no torch
    import, see the module docstring); else whatever ``AutoTokenizer`` picks."""
    config = folder / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    direct = (folder / "tokenizer.json").is_file() and (from_cache or name in _PLAIN_CLASSES)
    loader = _tokenizers_backed_class(name) if direct else None
    if loader is None:
        from transformers import AutoTokenizer as loader
    return loader.from_pretrained(str(folder), local_files_only=True)


def _tokenizers_backed_class(name: object) -> type | None:
    """transformers' tokenizer class ``name`` if it keeps the tokenizer wholly in ``tokenizer.json``
    (a ``TokenizersBackend``), else ``None``. The package's attribute imports that class's module only."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    found = getattr(transformers, name, None) if isinstance(name, str) else None
    return found if isinstance(found, type) and issubclass(found, TokenizersBackend) else None


def _cache_dir(gguf: Path) -> Path:
    """The cached tokenizer folder of the GGUF file ``gguf`` (see the module docstring)."""
    stat = gguf.stat()
    key = f"{gguf.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}"
    return user_cache_dir("tokenizers") / hashlib.sha256(key.encode()).hexdigest()[:16]


def _save(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Save ``tokenizer`` to ``folder`` whole or not at all (written aside, then renamed into place)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
        tokenizer.save_pretrained(str(staged))
        try:
            staged.rename(folder)
        except OSError:  # another process saved it first
            shutil.rmtree(staged, ignore_errors=True)
    except OSError as exc:
        log.warning("tokenizer not cached in %s (%s): the next start builds it from the file again", folder, exc)
