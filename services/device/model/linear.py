"""The dense linear layer of every family: ``y = x @ W.T + b`` in its device's fastest weight layout (oneDNN-packed, AMX-packed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stageserve.device.kernels import cpu_kernels


class Linear:
    """``y = x @ weight.T + bias``: ``x`` [..., in] -> [..., out], with the weight held in its device's fastest layout.

    On a CPU with oneDNN, float32 and (where oneDNN supports it) bfloat16 weights are reordered once
    into oneDNN's blocked layout and run through ``torch.ops.mkldnn._linear_pointwise`` (the packed
    linear torch.compile's inductor emits on CPU). Measured on a 2-core AVX-512 CPU (torch 2.13),
    the model's matmuls at 1-64 rows ran 1.5-2.8x faster in bfloat16 and 3.7-4.4x faster in float32
    (where ``F.linear`` goes to MKL's sgemm) than through ``F.linear``. Everywhere else: ``F.linear``.

    ``amx``: also keep an AMX-packed copy (``cpu_kernels.amx_pack``, where ``cpu_kernels.amx_ready``)
    for inputs of at most ``AMX_MAX_ROWS`` rows, a decode step's: ``cpu_kernels.amx_linear`` runs them
    ~20 % faster than oneDNN, at the cost of a second copy of the weight. ``gated``: the weight is
    SwiGLU's ``[gate; up]``, run through ``swiglu`` (the CPU kernels'), on ``cpu_kernels.amx_swiglu``
    where packed for it; an AMX-only gated copy has no plain product.
    ``one_copy``: where the AMX copy is made, keep no other: larger inputs run on it 64 rows at a time
    (the dense companion of a quantized linear, see ``quant.QuantizedLinear``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, amx: bool = False, gated: bool = False, one_copy: bool = False) -> None:
        """``weight`` [out, in] and ``bias`` [out] already on their device, same dtype."""
        self.bias, self.gated = bias, gated
        self.amx_weight = None
        if amx and cpu_kernels.amx_ready(weight, gated) and not (gated and bias is not None):  # amx_swiglu takes no bias
            self.amx_weight = (cpu_kernels.amx_pack_gated if gated else cpu_kernels.amx_pack)(weight)
        self.amx_only = one_copy and self.amx_weight is not None
        self.packed = _can_pack(weight) and not self.amx_only
        self.weight = None if self.amx_only else torch.ops.mkldnn._reorder_linear_weight(weight) if self.packed else weight

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this linear holds (for memory accounting)."""
        return [t for t in (self.weight, self.amx_weight, self.bias) if t is not None]

    def _on_amx(self, x: torch.Tensor) -> bool:
        return self.amx_weight is not None and x.dim() == 2 and (x.shape[0] <= cpu_kernels.AMX_MAX_ROWS or self.amx_only)

    def _amx_rows(self, op, x: torch.Tensor, *extra) -> torch.Tensor:
        """``op(x, amx_weight, *extra)`` over ``x`` [T, in] in slices of at most ``AMX_MAX_ROWS`` rows."""
        rows = cpu_kernels.AMX_MAX_ROWS
        if x.shape[0] <= rows:
            return op(x, self.amx_weight, *extra)
        return torch.cat([op(x[i : i + rows], self.amx_weight, *extra) for i in range(0, x.shape[0], rows)])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [..., in] -> [..., out], in ``x``'s dtype."""
        if not self.gated and self._on_amx(x):
            return self._amx_rows(cpu_kernels.amx_linear, x, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of this ``[gate; up]`` projection of ``x`` [T, in] -> [T, out / 2] (CPU kernels only)."""
        if self._on_amx(x):
            return self._amx_rows(cpu_kernels.amx_swiglu, x)
        return cpu_kernels.silu_and_mul(self(x))


def _can_pack(weight: torch.Tensor) -> bool:
    """Whether ``weight`` can take oneDNN's packed linear path (CPU, oneDNN built in, a dtype it runs natively)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
