"""The mixture-of-experts MLP every MoE family shares (Qwen3-MoE, Mixtral, DeepSeek-V2/V3): a router
choosing each token's top-k experts, the experts run as one grouped pass each over the rows routed to
it, and DeepSeek's shared experts beside them.

Math as transformers' ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock`` (``modeling_qwen3_moe.py``,
``modeling_mixtral.py``) and llama.cpp's ``build_moe_ffn`` (``src/llama-graph.cpp``, used by
``src/models/qwen3moe.cpp``): router logits ``h @ W_r.T``, probabilities softmax over all experts
(float32), the top k kept and, with ``norm_topk_prob``, divided by their sum (Mixtral's softmax over
the selected logits is the same); the output is the weighted sum of the chosen experts' SwiGLU MLPs
(Shazeer et al. 2017, "Outrageously Large Neural Networks"; Lepikhin et al. 2020, "GShard"; Jiang et
al. 2024, "Mixtral of Experts"). DeepSeek's router (transformers' ``DeepseekV2TopkRouter`` /
``DeepseekV3TopkRouter``; DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" §2.1.2): sigmoid scores
(V3) with a per-expert correction bias that steers the choice but not the weights, the choice limited
to each token's best expert groups, the weights times ``routed_scaling_factor``; shared experts
(Dai et al. 2024, "DeepSeekMoE") run on every token and are added unweighted.

The grouped pass sorts the step's (token, expert) pairs by expert with torch ops (``sort``,
``unique_consecutive``, ``index_select``, ``index_add_``): each expert that any row chose runs once
over its rows, so a decode step costs the active experts, not all of them. Each expert's linears
are the decoder's own (dense, or a quantized kernel where the GGUF's experts are quantized). The
experts' row counts come to the host to slice the sorted rows: free on the CPU, but on CUDA/NPU a
sync per MoE layer that would make a submit wait for the step before it. There `every_expert` runs
instead: each expert over every row, weighted 0 where a row did not choose it: no sync, correct,
and as costly as all the experts, which a fused MoE kernel (vLLM's ``fused_moe``, ``torch_npu``'s
grouped matmul) would replace.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stageserve.device.kernels import cpu_kernels
from stageserve.device.kernels.quant_linear import QuantizedLinear
from stageserve.device.model.linear import Linear

AnyLinear = Linear | QuantizedLinear


class KernelRouter:
    """A router on the CPU kernels (`cpu_kernels.router_logits`): ``x`` [T, hidden] -> float32 logits [T, E]
    from a float32 copy of the weight [E, hidden] (E x hidden: a few hundred KiB at most).

    Why an op of its own: the fused decode layers (`fused_decode`, ``csrc/moe.cpp``) call it too, so a
    step routes alike on either path, and each row's logits are summed in one fixed order whatever the
    rows beside it (by construction, not by which kernel a library picks for the row count). The
    logits stay float32 (transformers rounds them to the activation dtype before its float32 softmax;
    in float32 the two are the same computation)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [T, hidden] bfloat16 or float32 -> float32 logits [T, E]. Raises ``RuntimeError`` for another
        hidden size or dtype (`cpu_kernels.router_logits`)."""
        return cpu_kernels.router_logits(x.contiguous(), self.weight)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this router holds (for memory accounting)."""
        return [self.weight]


def route(
    logits: torch.Tensor, top_k: int, normalize: bool, scoring: str = "softmax", bias: torch.Tensor | None = None,
    groups: int = 1, groups_kept: int = 1, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's experts and their weights from router ``logits`` [T, E] (any float dtype).

    Scores are the softmax over all E experts or each expert's sigmoid (``scoring``), in float32;
    the experts are chosen by the scores plus ``bias`` (float32 [E], DeepSeek-V3's
    ``e_score_correction_bias``, or ``None``) among the ``groups_kept`` best of ``groups`` equal
    groups (a group's score: its best choice score with softmax, its best two's sum with sigmoid);
    their weights are their scores, divided by their sum with ``normalize``, times ``scale``.

    Returns ``(weights, experts)``: float32 [T, top_k] and int64 [T, top_k] expert indices, highest
    first (``torch.topk``, so ties break as in transformers' routers)."""
    scores = F.softmax(logits, dim=-1, dtype=torch.float32) if scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias
    if groups > 1:
        per_group = choice.view(choice.shape[0], groups, -1)
        group_scores = per_group.max(-1).values if scoring == "softmax" else per_group.topk(2, dim=-1).values.sum(-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_scores.topk(groups_kept, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(per_group.shape[2], dim=1), float("-inf"))
    experts = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # transformers' DeepSeek epsilon; nothing at float32 otherwise
    return weights * scale if scale != 1.0 else weights, experts


def grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert(experts[t, k], x[t])`` for every row t, one call per chosen expert.

    Args:
        x: [T, hidden] the MLP's input (any device, float dtype).
        weights: float32 [T, k] each row's expert weights (`route`).
        experts: int64 [T, k] each row's expert indices.
        expert: ``expert(e, rows)`` -> expert ``e``'s output [n, hidden] for its input rows [n, hidden].

    A single row (a one-stream decode step) skips the sort and gather: its experts run in ascending
    order and are added up as the sorted pass adds them, so its result is the same bit for bit, in
    about a third of the small ops (the torch ops' overhead is most of a one-row MoE layer's time).

    Returns:
        [T, hidden] in ``x``'s dtype, accumulated in float32 over the k experts of each row.
    """
    if x.shape[0] == 1:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, weight in sorted(zip(experts[0].tolist(), weights[0].tolist())):
            out.add_(expert(e, x).float() * weight)
        return out.to(x.dtype)
    top_k = experts.shape[1]
    chosen, order = experts.flatten().sort(stable=True)  # the (row, slot) pairs grouped by expert
    ids, counts = torch.unique_consecutive(chosen, return_counts=True)
    rows = order // top_k  # [T * k] the row each sorted pair came from
    grouped = x.index_select(0, rows)
    outputs = [expert(e, part) for e, part in zip(ids.tolist(), grouped.split(counts.tolist()))]
    weighted = torch.cat(outputs).float() * weights.flatten()[order, None]
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, rows, weighted).to(x.dtype)


def every_expert(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, expert: Callable[[int, torch.Tensor], torch.Tensor], num_experts: int,
) -> torch.Tensor:
    """What `grouped_experts` computes (same arguments; ``num_experts`` E), with no value read back
    to the host: every expert runs over all T rows, its output weighted by each row's weight for it
    (0 where the row did not choose it). For accelerators, where a host read is a sync."""
    gates = torch.zeros(x.shape[0], num_experts, dtype=torch.float32, device=x.device).scatter_(1, experts, weights)  # [T, E]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        out.addcmul_(expert(e, x).float(), gates[:, e:e + 1])
    return out.to(x.dtype)


@dataclass
class MoEMLP:
    """One layer's mixture of experts: ``router`` [hidden] -> [E] logits (dense, or `KernelRouter`), and each expert's fused
    ``[gate; up]`` ([hidden] -> [2 * moe_intermediate]) and ``down`` linears; the routing options
    as in `route` (``bias`` float32 [E]); ``shared``: the shared experts' fused ``(gate_up, down)``
    (DeepSeek), or ``None``."""

    router: AnyLinear | KernelRouter
    gate_ups: Sequence[AnyLinear]
    downs: Sequence[AnyLinear]
    top_k: int
    normalize: bool
    scoring: str = "softmax"
    bias: torch.Tensor | None = None
    groups: int = 1
    groups_kept: int = 1
    scale: float = 1.0
    shared: tuple[AnyLinear, AnyLinear] | None = None

    def __call__(self, x: torch.Tensor, mlp: Callable[[AnyLinear, AnyLinear, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``x`` [T, hidden] -> [T, hidden] in ``x``'s dtype; ``mlp(gate_up, down, rows)`` runs one expert's
        gated MLP (the decoder's, on its fused kernels or torch ops)."""
        weights, experts = route(self.router(x), self.top_k, self.normalize, self.scoring, self.bias, self.groups, self.groups_kept, self.scale)
        run = lambda e, rows: mlp(self.gate_ups[e], self.downs[e], rows)  # noqa: E731
        if x.device.type == "cpu":
            out = grouped_experts(x, weights, experts, run)
        else:
            out = every_expert(x, weights, experts, run, len(self.gate_ups))
        return out if self.shared is None else out + mlp(*self.shared, x)

    def linears(self) -> list[AnyLinear | KernelRouter]:
        """The router's, every expert's and the shared experts' linears."""
        return [self.router, *self.gate_ups, *self.downs, *(self.shared or ())]
