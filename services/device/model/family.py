"""The registry of model families: what one architecture adds to the shared decoder, under the names it is known by.

A family is one module of ``families/`` that calls :func:`register` at import; the registry imports
every module there the first time a name is looked up, so adding a family touches no other file
(the steps: ``README.md`` beside this module).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_FAMILIES: list[Family] = []
_loaded = False


@dataclass(frozen=True)
class Family:
    """One architecture: the names that select it and what it adds to the shared decoder.

    ``name`` becomes ``ModelConfig.architecture``. ``hf_model_types`` are the ``model_type`` values
    of a Hugging Face ``config.json`` it reads, ``gguf_architectures`` the ``general.architecture``
    values of a GGUF file. ``hf_fields`` maps the parsed ``config.json`` to the family's own
    `ModelConfig` fields (``attention_bias``, ``qk_norm``; what is not named keeps its default);
    from a GGUF file those come from the tensors present. ``gguf_qk_permuted``: llama.cpp's
    converter reorders this family's Q/K rows for its adjacent-pair RoPE (``LlamaModel.permute``
    in ``convert_hf_to_gguf.py``), so the loader undoes it. ``gguf_partial_rotary``: the GGUF's
    ``{arch}.rope.dimension_count`` counts only the rotating values of a head (llama.cpp's ``n_rot``,
    ``Phi3MiniModel``), whose size is then ``key_length`` or hidden / heads.

    What only some families need: ``hf_config`` turns the family's ``config.json`` into the shape
    the common reader takes (Gemma 3: the ``text_config`` of a multimodal config, the global
    layers' ``rope_parameters``, the defaults of keys its configs omit); ``hf_fields`` may also
    return ``layer_types`` (``full_attention`` / ``sliding_attention`` per layer), which the
    reader turns into ``ModelConfig.full_attention_layers``. ``hf_norm_offset``: added to every
    RMSNorm weight of a Hugging Face checkpoint at load (Gemma's ``(1 + w)`` norms), so the
    decoder multiplies by the stored weight as llama.cpp's GGUF already stores it.
    ``hf_weight_prefixes``: ``(prefix, replacement)`` pairs renaming a checkpoint's tensors into
    the decoder's names (a multimodal checkpoint's language model); ``hf_weight_names`` renames each
    tensor after them (Mixtral's ``block_sparse_moe.experts.{j}.w1`` into ``mlp.experts.{j}.gate_proj``). ``gguf_fields`` maps the GGUF
    metadata (``{arch}.*`` keys), its architecture name and the common fields read so far to
    the family's own fields where GGUF has no key for them (llama.cpp derives them from the
    architecture). The hooks raise :class:`Unsupported` for what the decoder cannot run; the reader
    names the file.
    """

    name: str
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    hf_fields: Callable[[Mapping[str, Any]], dict[str, Any]]
    gguf_qk_permuted: bool = False
    gguf_partial_rotary: bool = False
    hf_config: Callable[[Mapping[str, Any]], Mapping[str, Any]] = lambda raw: raw
    hf_norm_offset: float = 0.0
    hf_weight_prefixes: tuple[tuple[str, str], ...] = ()
    hf_weight_names: Callable[[str], str] = lambda name: name
    gguf_fields: Callable[[Mapping[str, Any], str, Mapping[str, Any]], dict[str, Any]] = lambda fields, arch, common: {}


class Unsupported(ValueError):
    """A family hook's refusal of a config it cannot run: the message names the field and the supported values, not the file."""


def register(family: Family) -> Family:
    """Add ``family`` to the registry and return it. Raises ``ValueError`` for a name another family already claims."""
    for other in _FAMILIES:
        taken = ({family.name} & {other.name}) | (set(family.hf_model_types) & set(other.hf_model_types)) \
            | (set(family.gguf_architectures) & set(other.gguf_architectures))
        if taken:
            raise ValueError(f"model family {family.name!r}: {', '.join(sorted(taken))} already registered by {other.name!r}")
    _FAMILIES.append(family)
    return family


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order (``families/`` modules load on the first call)."""
    global _loaded
    if not _loaded:
        _loaded = True
        from stageserve.device.model import families as package

        for module in sorted(info.name for info in pkgutil.iter_modules(package.__path__)):
            importlib.import_module(f"{package.__name__}.{module}")
    return tuple(_FAMILIES)


def family_named(name: str) -> Family:
    """The family whose ``name`` (``ModelConfig.architecture``) is ``name``. Raises ``KeyError`` for none."""
    found = next((f for f in families() if f.name == name), None)
    if found is None:
        raise KeyError(f"no model family {name!r}")
    return found


def family_for_hf(model_type: object) -> Family | None:
    """The family reading ``config.json``'s ``model_type``, or ``None``."""
    return next((f for f in families() if model_type in f.hf_model_types), None)


def family_for_gguf(architecture: object) -> Family | None:
    """The family reading GGUF ``general.architecture``, or ``None``."""
    return next((f for f in families() if architecture in f.gguf_architectures), None)


def hf_model_types() -> tuple[str, ...]:
    """Every supported ``model_type``, sorted (for error messages)."""
    return tuple(sorted(t for f in families() for t in f.hf_model_types))


def gguf_architectures() -> tuple[str, ...]:
    """Every supported GGUF ``general.architecture``, sorted (for error messages)."""
    return tuple(sorted(a for f in families() for a in f.gguf_architectures))
