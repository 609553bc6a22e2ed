"""The model's own sampling defaults, used where a request leaves a value unset (vLLM's default
``--generation-config auto``).

Read from a Hugging Face directory's ``generation_config.json`` (``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``, and only when ``do_sample`` is not false: a greedy
config sets none), or a GGUF file's ``general.sampling.*`` keys (``temp``, ``top_p``, ``top_k``,
``min_p``, ``penalty_repeat``: what llama.cpp's converter writes from ``generation_config.json``
and ``llama-server`` applies), read with the header reader that skips the vocabulary (~30 ms). A
value set in the request always wins; ``top_k`` and ``min_p``, which the gRPC API has no "unset"
for, take the model's value when sent as 0.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from stageserve.gguf_header import read_gguf_metadata
from stageserve.v1 import prepare_pb2

log = logging.getLogger(__name__)

_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty"}
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p", "general.sampling.top_k": "top_k",
              "general.sampling.min_p": "min_p", "general.sampling.penalty_repeat": "repetition_penalty"}


def load_sampling_defaults(model_path: Path) -> prepare_pb2.GenerateRequest:
    """The model's sampling defaults as a ``GenerateRequest`` holding only them (empty when it has none).

    Raises:
        ValueError: ``generation_config.json`` is not a JSON object, or the GGUF header is corrupt
            (the message names the file).
    """
    values = _gguf_values(model_path) if model_path.is_file() else _hf_values(model_path)
    defaults = prepare_pb2.GenerateRequest(**values)
    if values:
        log.info("sampling defaults from the model, where a request leaves them unset: %s",
                 ", ".join(f"{k}={v:g}" for k, v in values.items()))
    return defaults


def with_defaults(request: prepare_pb2.GenerateRequest, defaults: prepare_pb2.GenerateRequest) -> prepare_pb2.GenerateRequest:
    """``request`` with ``defaults`` filled into what it leaves unset (``request`` itself when there are none)."""
    if defaults.ByteSize() == 0:
        return request
    merged = prepare_pb2.GenerateRequest()
    merged.CopyFrom(defaults)
    merged.MergeFrom(request)  # fields the request sets overwrite; unset ones keep the model's
    return merged


def _gguf_values(path: Path) -> dict[str, float]:
    fields = read_gguf_metadata(path)
    return {field: fields[key] for key, field in _GGUF_KEYS.items() if isinstance(fields.get(key), (int, float))}


def _hf_values(directory: Path) -> dict[str, float]:
    path = directory / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    if config.get("do_sample") is False:  # greedy by default: its sampling values are not meant to apply
        return {}
    return {field: config[key] for key, field in _HF_KEYS.items() if isinstance(config.get(key), (int, float))}

