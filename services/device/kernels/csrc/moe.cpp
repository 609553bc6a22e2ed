// The mixture-of-experts MLP of a decode step in C++ (decode_layers.cpp calls it for a MoE layer), and
// its router's logits as an op of their own, which the Python path (model/moe.py `KernelRouter`)
// calls too, so that both paths route alike.
//
// router_logits: x [T, K] @ W^T with W float32 [E, K], each dot summed in float32 in one fixed order
// (16 lanes, then the lanes' sum), so a row's logits never depend on the other rows of its step by
// construction, and not rounded to bfloat16 before the softmax (transformers rounds them to the
// activation dtype first; at float32 the two agree).
//
// moe_mlp: the same ATen ops, in the same order, as model/moe.py's `route` (softmax, no groups, no
// bias, scale 1) and `grouped_experts`, so its result is the Python path's bit for bit: one row runs
// its experts in ascending order and adds them into a float32 sum; more rows are sorted by expert
// (stable), each chosen expert runs once over its rows, and the weighted outputs are index-added. The chosen
// experts run in one call (`run_experts`: in decode_layers.cpp, their gate_ups in one quant_linear_segments,
// then their downs in another), each row's output the same bits as its expert's alone.

#include "ops.h"
#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace stageserve {

namespace {

template <typename T>
SS_AVX512 float dot_row(const T* x, const float* w, int64_t k) {
  const int64_t full = k / 16 * 16;
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < full; i += 16) sum = _mm512_fmadd_ps(load16(x + i), _mm512_loadu_ps(w + i), sum);
  if (full < k) {
    const __mmask16 tail = tail_mask(k - full);
    sum = _mm512_fmadd_ps(load16(x + full, tail), _mm512_maskz_loadu_ps(tail, w + full), sum);
  }
  return _mm512_reduce_add_ps(sum);
}

}  // namespace

at::Tensor router_logits(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(cpu_has_avx512(), "router_logits needs an x86-64 CPU with AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && is_kernel_dtype(x.scalar_type()),
              "router_logits: x must be contiguous [tokens, hidden] bfloat16 or float32, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kFloat && weight.size(1) == x.size(1),
              "router_logits: weight must be contiguous float32 [experts, hidden] with x's hidden size ", x.size(1), ", got ",
              weight.sizes(), " ", weight.scalar_type());
  const int64_t rows = x.size(0), experts = weight.size(0), k = x.size(1);
  at::Tensor out = at::empty({rows, experts}, x.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const float* w = weight.const_data_ptr<float>();
  dispatch_kernel_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    // ~256K multiply-adds per thread at least: a one-row decode step's router (E * K of them) stays on
    // the calling thread rather than paying a thread hand-off; a prefill's splits.
    at::parallel_for(0, rows * experts, std::max<int64_t>(1, (int64_t{1} << 18) / k), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i] = dot_row(xp + (i / experts) * k, w + (i % experts) * k, k);
    });
  });
  return out;
}

at::Tensor moe_mlp(const at::Tensor& x, const at::Tensor& router, int64_t top_k, bool normalize, const ExpertsFn& run_experts) {
  TORCH_CHECK(top_k >= 1 && top_k <= router.size(0), "moe_mlp: top_k ", top_k, " of ", router.size(0), " experts");
  // route(): softmax over all experts in float32, the top k, divided by their sum with normalize
  const at::Tensor scores = at::softmax(router_logits(x, router), -1, at::kFloat);
  const at::Tensor experts = std::get<1>(at::topk(scores, top_k, -1));
  at::Tensor weights = scores.gather(1, experts);
  if (normalize) weights = weights / (weights.sum(-1, /*keepdim=*/true) + 1e-20);
  // grouped_experts()
  if (x.size(0) == 1) {
    std::vector<std::pair<int64_t, double>> chosen;
    const at::Tensor e_row = experts.contiguous(), w_row = weights.contiguous();
    const int64_t* e = e_row.const_data_ptr<int64_t>();
    const float* w = w_row.const_data_ptr<float>();
    for (int64_t j = 0; j < top_k; ++j) chosen.emplace_back(e[j], static_cast<double>(w[j]));
    std::sort(chosen.begin(), chosen.end());
    std::vector<int64_t> ids;
    for (const auto& choice : chosen) ids.push_back(choice.first);
    const at::Tensor outputs = run_experts(ids, x.expand({top_k, x.size(1)}).contiguous(), std::vector<int64_t>(top_k, 1));
    at::Tensor out = at::zeros(x.sizes(), x.options().dtype(at::kFloat));
    for (int64_t j = 0; j < top_k; ++j) out.add_(outputs.narrow(0, j, 1).to(at::kFloat) * chosen[j].second);
    return out.to(x.scalar_type());
  }
  const auto [sorted, order] = at::sort(experts.flatten(), /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const auto [ids, unused_inverse, counts] = at::unique_consecutive(sorted, /*return_inverse=*/false, /*return_counts=*/true);
  const at::Tensor rows = at::floor_divide(order, top_k);
  const at::Tensor sizes = counts.contiguous(), expert_ids = ids.contiguous();
  const int64_t *size = sizes.const_data_ptr<int64_t>(), *id = expert_ids.const_data_ptr<int64_t>();
  const at::Tensor outputs = run_experts(std::vector<int64_t>(id, id + expert_ids.numel()), x.index_select(0, rows),
                                         std::vector<int64_t>(size, size + sizes.numel()));
  const at::Tensor weighted = outputs.to(at::kFloat) * weights.flatten().index_select(0, order).unsqueeze(1);
  return at::zeros(x.sizes(), x.options().dtype(at::kFloat)).index_add_(0, rows, weighted).to(x.scalar_type());
}

}  // namespace stageserve
