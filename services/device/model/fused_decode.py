"""A decode-only step's decoder layers as one call into the CPU kernels (``cpu_kernels.decode_layers``).

The model's fused path (`DecoderModel._layers_fused`) calls ~10 ops a layer from Python; each call
releases the GIL and takes it back. Served, the device's other Python threads (its gRPC streams'
handlers, the completion lane) take the GIL in between, and the compute thread then waits for it on
every op's return: on a 2-core AMD EPYC at one stream, ~18 such waits and ~1.4 ms a token
(docs/benchmarks.md, "One stream: the GIL"). `FusedDecodeLayers` runs the same ops in the same order
in C++ (bit for bit the same result), so the GIL is released once a step and the interpreter's
per-op work is gone.

It takes what the decode path of most served models is: layers with grouped-query attention (q/k
norms, sliding windows and RoPE tables per layer included), a SwiGLU MLP or a mixture of SwiGLU
experts with softmax routing (Qwen3-MoE, Mixtral: `moe.KernelRouter`, no shared experts, the experts'
linears of one format), and every linear on the VNNI kernel at the step's row count (any row count
where no linear keeps a dense copy: there the kernel takes them all, `QuantizedLinear`). Anything
else (a prefill row, DeepSeek's latent attention and routing, Gemma's sandwich norms or GeGLU, a
linear on a dense copy or on torch's kernels) keeps the Python path.
"""

from __future__ import annotations

import torch

from stageserve.device.kernels import cpu_kernels
from stageserve.device.kernels.quant_linear import QuantizedLinear, VnniKernel
from stageserve.device.model.forward_batch import ForwardBatch
from stageserve.device.model.kv_cache import PagedKVCache
from stageserve.device.model.moe import KernelRouter, MoEMLP


class FusedDecodeLayers:
    """The flattened layers of one model for ``cpu_kernels.decode_layers``.

    Args:
        model: a `DecoderModel` whose ``cpu_kernels`` are in use; build with `for_model`, which
            returns ``None`` where a layer is not of the kind described in the module docstring.
    """

    def __init__(self, model) -> None:
        c = model.config
        self._model = model
        self._input_norms = [layer.input_norm for layer in model.layers]
        self._post_norms = [layer.post_norm for layer in model.layers]
        self._qk_norms = [n for layer in model.layers for n in (layer.q_norm, layer.k_norm)] if model.layers[0].q_norm is not None else []
        self._linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, *_mlp_linears(layer))]
        self._moe_meta = [n for layer in model.layers
                          for n in ((len(layer.moe.gate_ups), layer.moe.top_k, layer.moe.normalize) if layer.moe else (0, 0, 0))]
        self._routers = [layer.moe.router.weight for layer in model.layers if layer.moe is not None]
        self._tensors: list[torch.Tensor] = []
        self._meta: list[int] = []
        for linear in self._linears:
            kernels = linear.kernel_parts()
            self._meta += [len(kernels), linear.bias is not None]
            for kernel in kernels:
                self._meta += [kernel.bits, kernel.input_bits, kernel.scheme]
                self._tensors += [kernel.packed, kernel.scales]
            if linear.bias is not None:
                self._tensors.append(linear.bias)
        self._cos = [cos for cos, _ in model.rope]
        self._signed_sin = [signed_sin for _, signed_sin in model.rope]
        self._windows = [window or 0 for window in model.layer_windows]
        self._layer_rope = list(model.layer_rope)
        self._softcap = c.attn_softcap or 0.0
        # The rows every linear runs on its kernel: any number where none keeps a dense copy (`QuantizedLinear`);
        # fixed when built, as the kernels' input levels in `_meta` (the model builds this after choosing its copies).
        copied = [linear.kernel.max_rows for linear in self._linears if linear.dense is not None]
        self._max_rows = min(copied) if copied else None

    @classmethod
    def for_model(cls, model) -> FusedDecodeLayers | None:
        """The fused layers of ``model``, or ``None`` where one of its layers is not of the kind this takes."""
        c = model.config
        if not model.cpu_kernels or c.hidden_act != "silu" or c.kv_lora_rank or not cpu_kernels.has_avx512_vnni():
            return None
        for layer in model.layers:
            if layer.mla is not None or layer.attn_out_norm is not None or layer.mlp_out_norm is not None:
                return None
            if layer.moe is not None and not _softmax_routed(layer.moe):
                return None
            if not all(map(_on_vnni, (layer.qkv, layer.o, *_mlp_linears(layer)))):
                return None
            if layer.moe is not None and not _experts_alike(layer.moe):
                return None
        return cls(model)

    def takes(self, batch: ForwardBatch) -> bool:
        """Whether ``batch`` is a decode-only step whose rows every linear runs on its VNNI kernel
        (`QuantizedLinear` sends more rows than the kernel's ``max_rows`` to a dense copy where it keeps one)."""
        fits = self._max_rows is None or batch.num_decode <= self._max_rows
        return 0 < batch.num_decode and fits and not batch.prefills

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: PagedKVCache) -> torch.Tensor:
        """The layers over embeddings ``x`` [T, hidden] (updated in place and returned, before the
        final norm) of a batch `takes` accepts; K/V written into ``kv_cache`` as the Python path does."""
        model, c = self._model, self._model.config
        cpu_kernels.decode_layers(
            x, self._input_norms, self._post_norms, self._qk_norms, self._tensors, self._meta, self._moe_meta, self._routers, kv_cache.kv,
            self._cos, self._signed_sin, self._layer_rope, self._windows, batch.positions, batch.slot_mapping, batch.decode_blocks,
            c.num_heads, c.num_kv_heads, model.scale, self._softcap, c.rms_norm_eps)
        return x


def _on_vnni(linear) -> bool:
    """Whether ``linear`` is a `QuantizedLinear` on the VNNI kernel (or on several, stacked)."""
    return isinstance(linear, QuantizedLinear) and all(isinstance(kernel, VnniKernel) for kernel in linear.kernel_parts())


def _mlp_linears(layer) -> list:
    """The MLP's linears in the order ``decode_layers`` reads them: ``gate_up``, ``down``, or each expert's two in turn."""
    if layer.moe is None:
        return [layer.gate_up, layer.down]
    return [lin for pair in zip(layer.moe.gate_ups, layer.moe.downs) for lin in pair]


def _experts_alike(moe: MoEMLP) -> bool:
    """Whether every expert's linears have the first's kernel formats (parts, bits, input levels, scales)
    and biases, as ``decode_layers`` runs a step's chosen experts in one call each for their gate_ups and
    downs (a GGUF file stores a layer's experts as one tensor a projection, of one type)."""
    def formats(linear) -> tuple:
        return linear.bias is not None, [(k.bits, k.input_bits, k.scheme) for k in linear.kernel_parts()]

    return all(formats(gate_up) == formats(moe.gate_ups[0]) and formats(down) == formats(moe.downs[0])
               for gate_up, down in zip(moe.gate_ups, moe.downs))


def _softmax_routed(moe: MoEMLP) -> bool:
    """Whether ``moe`` routes as ``csrc/moe.cpp`` does: `KernelRouter` logits, a softmax over every expert, its top k
    (normalized or not), no groups, correction bias or scale, no shared experts (Qwen3-MoE, Mixtral)."""
    return (isinstance(moe.router, KernelRouter) and moe.scoring == "softmax" and moe.bias is None and moe.groups == 1 and moe.scale == 1.0
            and moe.shared is None)
