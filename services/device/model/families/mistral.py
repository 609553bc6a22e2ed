"""Mistral / Ministral (transformers ``MistralForCausalLM``, ``modular_mistral.py``): Llama's layer
without biases, with sliding-window attention over every layer when ``sliding_window`` is set
(transformers' ``MistralConfig`` defaults it to 4096 when ``config.json`` omits it; ``null``: full
attention). llama.cpp's ``convert_hf_to_gguf.py`` writes Mistral as GGUF architecture ``llama``
(``LlamaModel`` registers ``MistralForCausalLM``), so a Mistral GGUF loads through the llama family."""

from __future__ import annotations

from stageserve.device.model.family import Family, register

FAMILY = register(Family(
    name="mistral",
    hf_model_types=("mistral",),
    gguf_architectures=(),
    hf_fields=lambda raw: {"sliding_window": raw.get("sliding_window", 4096)},
))
