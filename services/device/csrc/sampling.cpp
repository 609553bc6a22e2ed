// Greedy sampling's argmax over each row of the logits, read once in their own dtype (bfloat16 logits
// need no float32 copy: widening is exact, so the argmax is the same).
// Same result as torch.max(x, -1).indices: the first index of the row's maximum, or of its first NaN.
//
// Structured output's token bitmask applied to rows of the logits in place: -inf where a row's bit
// is 0 (xgrammar's layout: bit t % 32 of int32 word t / 32). 16 tokens per masked store, which on a
// little-endian CPU are exactly the 16 bits of half-word t / 16; only the forbidden lanes are written.

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>

namespace stageserve {

namespace {

// Per lane: the largest value seen and the first index holding it (strict > keeps the earlier index);
// then across lanes: the largest value, and on a tie the smallest index.
template <typename T>
SS_AVX512 int64_t argmax_row(const T* __restrict__ x, int64_t n) {
  const int64_t full = n / 16 * 16;
  __m512 best = _mm512_set1_ps(-INFINITY);
  __m512i best_index = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16, index = _mm512_add_epi32(index, step)) {
    const __mmask16 m = i < full ? __mmask16(0xFFFF) : tail_mask(n - full);
    const __m512 v = load16(x + i, m);
    const __mmask16 greater = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
    nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
  }
  if (nan) {  // as torch: a NaN is the maximum
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(static_cast<float>(x[i]))) return i;
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, top, _CMP_EQ_OQ);
  // A row of -inf never passes the > test: index 0 then, as torch.
  return _mm512_mask_reduce_min_epi32(at_top, best_index);
}

SS_AVX512 void forbid16(float* p, __mmask16 m) { _mm512_mask_storeu_ps(p, m, _mm512_set1_ps(-INFINITY)); }
SS_AVX512 void forbid16(c10::BFloat16* p, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, _mm256_set1_epi16(static_cast<int16_t>(0xFF80))); }

template <typename T>
SS_AVX512 void mask_row(T* __restrict__ x, const uint16_t* __restrict__ allowed, int64_t n) {
  const int64_t full = n / 16 * 16;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = i < full ? __mmask16(0xFFFF) : tail_mask(n - full);
    const __mmask16 forbidden = static_cast<__mmask16>(~allowed[i / 16]) & lanes;
    if (forbidden) forbid16(x + i, forbidden);
  }
}

}  // namespace

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, at::IntArrayRef rows) {
  TORCH_CHECK(cpu_has_avx512(), "apply_token_bitmask_ needs an x86-64 CPU with AVX-512");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && is_kernel_dtype(logits.scalar_type()),
              "logits must be [rows, V] bfloat16 or float32 with contiguous rows, got ", logits.sizes(), " ", logits.scalar_type());
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt && bitmask.size(0) == logits.size(0),
              "bitmask must be a contiguous int32 [", logits.size(0), ", words], got ", bitmask.sizes(), " ", bitmask.scalar_type());
  const int64_t n = std::min<int64_t>(logits.size(1), bitmask.size(1) * 32), stride = logits.stride(0);
  for (const int64_t r : rows) TORCH_CHECK(r >= 0 && r < logits.size(0), "row ", r, " is outside the ", logits.size(0), " rows");
  const auto* words = reinterpret_cast<const uint16_t*>(bitmask.const_data_ptr<int32_t>());
  const int64_t halves_per_row = bitmask.size(1) * 2;
  dispatch_kernel_dtype(logits.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* xp = logits.data_ptr<T>();
    for (const int64_t r : rows) mask_row<T>(xp + r * stride, words + r * halves_per_row, n);
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(cpu_has_avx512(), "argmax_rows needs an x86-64 CPU with AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && is_kernel_dtype(x.scalar_type()),
              "x must be [rows, n] bfloat16 or float32 with contiguous rows, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(x.size(1) >= 1 && x.size(1) <= INT32_MAX, "rows must hold 1 to 2^31 - 1 values, got ", x.size(1));
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  dispatch_kernel_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row<T>(xp + r * stride, n);
    });
  });
  return out;
}

}  // namespace stageserve
