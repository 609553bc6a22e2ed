"""The mixture-of-experts MLP (``services/device/model/moe.py``): routing as transformers' top-k router,
and the grouped pass (rows sorted by expert, one call per chosen expert) equal to a naive per-token sum."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stageserve.device.model.linear import Linear
from stageserve.device.model.moe import MoEMLP, every_expert, grouped_experts, route

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 8, 2, 16, 24


def _gated(gate_up: Linear, down: Linear, x: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up(x).chunk(2, dim=-1)
    return down(F.silu(gate) * up)


def _moe(normalize: bool) -> MoEMLP:
    g = torch.Generator().manual_seed(0)
    return MoEMLP(
        router=Linear(torch.randn(EXPERTS, HIDDEN, generator=g)),
        gate_ups=[Linear(torch.randn(2 * INTERMEDIATE, HIDDEN, generator=g) * 0.3) for _ in range(EXPERTS)],
        downs=[Linear(torch.randn(HIDDEN, INTERMEDIATE, generator=g) * 0.3) for _ in range(EXPERTS)],
        top_k=TOP_K, normalize=normalize)


def test_routing_is_the_top_k_of_the_softmax_renormalised_where_asked():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    probs = logits.softmax(-1)
    weights, experts = route(logits, 2, normalize=False)
    assert experts.tolist() == [[1, 2], [3, 0]] and torch.allclose(weights, probs.gather(1, experts))
    weights, _ = route(logits, 2, normalize=True)  # Mixtral: the softmax over the two selected logits
    assert torch.allclose(weights, logits.gather(1, experts).softmax(-1))


def test_the_grouped_pass_equals_a_naive_sum_over_each_tokens_experts():
    """37 rows (a prefill's) and 1 row (a decode's), with and without renormalised weights: each row's
    weighted sum of its own experts' MLPs, computed token by token, within float32 rounding."""
    for normalize in (False, True):
        moe = _moe(normalize)
        for rows in (37, 1):
            x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
            weights, experts = route(moe.router(x), TOP_K, normalize)
            naive = torch.stack([
                sum(weights[t, k] * _gated(moe.gate_ups[e], moe.downs[e], x[t : t + 1])[0] for k, e in enumerate(experts[t].tolist()))
                for t in range(rows)])
            assert torch.allclose(moe(x, _gated), naive, atol=1e-5)


def test_only_the_chosen_experts_run_each_once_over_its_rows():
    """A decode step's cost follows its active experts: an expert nobody chose is never called, and
    each chosen one once, over exactly the rows routed to it."""
    x = torch.arange(4.0).repeat_interleave(HIDDEN).view(4, HIDDEN)  # row t holds t everywhere
    experts = torch.tensor([[5, 1], [1, 6], [5, 6], [1, 5]])
    calls: dict[int, list[float]] = {}

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        assert e not in calls, f"expert {e} called twice"
        calls[e] = rows[:, 0].tolist()
        return rows * (e + 1)

    out = grouped_experts(x, torch.full((4, 2), 0.5), experts, expert)
    assert {e: sorted(rows) for e, rows in calls.items()} == {1: [0.0, 1.0, 3.0], 5: [0.0, 2.0, 3.0], 6: [1.0, 2.0]}
    assert out[:, 0].tolist() == [0.5 * (6 + 2) * 0, 0.5 * (2 + 7) * 1, 0.5 * (6 + 7) * 2, 0.5 * (2 + 6) * 3]


def test_a_row_alone_gets_the_bits_it_gets_in_a_batch():
    """One row (the decode step's shortcut, no sort) adds its experts in the sorted pass's order: its
    output equals, bit for bit, what the same row gets among 37 (top 3 of 8, so the order of the
    float32 additions matters; the expert is elementwise, so its own output cannot depend on the batch)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(37, HIDDEN, generator=g)
    weights, experts = route(torch.randn(37, EXPERTS, generator=g), 3, normalize=True)
    expert = lambda e, rows: torch.sin(rows * (e + 1.37)) * 1e3  # noqa: E731
    batch = grouped_experts(x, weights, experts, expert)
    for t in (0, 5, 36):
        assert torch.equal(grouped_experts(x[t : t + 1], weights[t : t + 1], experts[t : t + 1], expert), batch[t : t + 1])


def test_the_accelerators_pass_of_every_expert_equals_the_grouped_one():
    """`every_expert` (no host read: CUDA/NPU) gives the grouped pass's output within float32 rounding."""
    moe = _moe(normalize=True)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(5))
    weights, experts = route(moe.router(x), TOP_K, True)
    run = lambda e, rows: _gated(moe.gate_ups[e], moe.downs[e], rows)  # noqa: E731
    torch.testing.assert_close(every_expert(x, weights, experts, run, EXPERTS), grouped_experts(x, weights, experts, run), rtol=0, atol=1e-5)


def _sorted_by_expert(weights: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = experts.argsort(dim=-1)
    return weights.gather(1, order), experts.gather(1, order)


def test_deepseek_routers_choose_and_weigh_as_transformers():
    """DeepSeek-V3's sigmoid router (correction bias, the best 2 of 4 groups by their best two experts,
    weights renormalised and scaled) and DeepSeek-V2's softmax ones (``greedy``, ``group_limited_greedy``
    by each group's best expert, scaled) choose the experts transformers' ``DeepseekV3TopkRouter`` /
    ``DeepseekV2TopkRouter`` choose, with their weights, for 37 random rows (the order of a row's
    experts aside: transformers' routers do not sort)."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, HIDDEN, generator=g)
    shape = dict(hidden_size=HIDDEN, num_attention_heads=4, n_routed_experts=EXPERTS, num_experts_per_tok=3, n_group=4, topk_group=2)
    v3 = DeepseekV3TopkRouter(DeepseekV3Config(**shape, routed_scaling_factor=2.5, norm_topk_prob=True))
    routers = [(v3, dict(scoring="sigmoid", groups=4, groups_kept=2, scale=2.5, normalize=True))]
    for method, groups in (("greedy", 1), ("group_limited_greedy", 4)):
        v2 = DeepseekV2TopkRouter(DeepseekV2Config(**shape, topk_method=method, routed_scaling_factor=2.0))
        routers.append((v2, dict(scoring="softmax", groups=groups, groups_kept=2, scale=2.0, normalize=False)))
    with torch.no_grad():
        for router, ours in routers:
            router.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=g))
            bias = getattr(router, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(EXPERTS, generator=g) * 0.3)
            _, hf_weights, hf_experts = router(x)
            weights, experts = route(x @ router.weight.T, 3, bias=bias, **ours)
            hf_weights, hf_experts = _sorted_by_expert(hf_weights, hf_experts)
            weights, experts = _sorted_by_expert(weights, experts)
            assert torch.equal(experts, hf_experts)
            torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-6)
