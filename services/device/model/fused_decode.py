"""A decode-only step's decoder layers as one call into the CPU kernels (``cpu_kernels.decode_layers``).

The model's fused path (`DecoderModel._layers_fused`) calls ~10 ops a layer from Python; each call
releases the GIL and takes it back. Served, the device's other Python threads (its gRPC streams'
handlers, the completion lane) take the GIL in between, and the compute thread then waits for it on
every op's return: on a 2-core AMD EPYC at one stream, ~18 such waits and ~1.4 ms a token
(docs/benchmarks.md, "One stream: the GIL"). `FusedDecodeLayers` runs the same ops in the same order
in C++ (bit for bit the same result), so the GIL is released once a step and the interpreter's
per-op work is gone.

It takes what the decode path of most served models is: layers with grouped-query attention (q/k
norms, sliding windows and RoPE tables per layer included), a SwiGLU MLP, and every linear on the
VNNI kernel at the step's row count (any row count where no linear keeps a dense copy: there the
kernel takes them all, `QuantizedLinear`). Anything else (a prefill row, a mixture of experts, latent
attention, Gemma's sandwich norms or GeGLU, a linear on a dense copy or on torch's kernels) keeps
the Python path.
"""

from __future__ import annotations

import torch

from stageserve.device.kernels import cpu_kernels
from stageserve.device.kernels.quant_linear import QuantizedLinear, VnniKernel
from stageserve.device.model.forward_batch import ForwardBatch
from stageserve.device.model.kv_cache import PagedKVCache


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
        self._linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
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
            if layer.moe is not None or layer.mla is not None or layer.attn_out_norm is not None or layer.mlp_out_norm is not None:
                return None
            if not all(_on_vnni(linear) for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)):
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
        h = cpu_kernels.rms_norm(x, self._input_norms[0], c.rms_norm_eps)
        cpu_kernels.decode_layers(
            x, h, self._input_norms, self._post_norms, self._qk_norms, self._tensors, self._meta, kv_cache.kv, self._cos,
            self._signed_sin, list(model.layer_rope), self._windows, batch.positions, batch.slot_mapping, batch.decode_blocks,
            batch.positions + 1, c.num_heads, c.num_kv_heads, model.scale, self._softcap, c.rms_norm_eps)
        return x


def _on_vnni(linear) -> bool:
    """Whether ``linear`` is a `QuantizedLinear` on the VNNI kernel (or on several, stacked)."""
    return isinstance(linear, QuantizedLinear) and all(isinstance(kernel, VnniKernel) for kernel in linear.kernel_parts())
