// Greedy sampling's argmax over each row of the logits, read once in their own dtype (bfloat16 logits
// need no float32 copy: widening is exact, so the argmax is the same).
// Same result as torch.max(x, -1).indices: the first index of the row's maximum, or of its first NaN.
//
// Random sampling's Gumbel-max draw, fused: temperature, cutoff, the counter-based noise and the
// argmax in one pass over each row, bit for bit the noise of sampler.py's torch ops (the logs are
// this file's own, within an ulp or two of torch's).
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

// The running argmax of a row fed 16 values at a time. Per lane: the largest value seen and the first
// index holding it (strict > keeps the earlier index); then across lanes: the largest value, and on
// a tie the smallest index. As torch, a NaN is the maximum: the first one wins.
struct RowArgmax {
  __m512 best;
  __m512i best_index, index;
  int64_t first_nan = -1;

  SS_AVX512 RowArgmax()
      : best(_mm512_set1_ps(-INFINITY)), best_index(_mm512_setzero_si512()),
        index(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)) {}

  // v: the values of indices i .. i + 15, valid in lanes m
  SS_AVX512 SS_INLINE void add(__m512 v, __mmask16 m, int64_t i) {
    const __mmask16 greater = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
    index = _mm512_add_epi32(index, _mm512_set1_epi32(16));
    if (first_nan < 0) {
      const __mmask16 nan = _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
      if (nan) first_nan = i + __builtin_ctz(nan);
    }
  }

  SS_AVX512 SS_INLINE int64_t result() const {
    if (first_nan >= 0) return first_nan;
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    const __mmask16 at_top = _mm512_cmp_ps_mask(best, top, _CMP_EQ_OQ);
    // A row of -inf never passes the > test: index 0 then, as torch.
    return _mm512_mask_reduce_min_epi32(at_top, best_index);
  }
};

template <typename T>
SS_AVX512 int64_t argmax_row(const T* __restrict__ x, int64_t n) {
  const int64_t full = n / 16 * 16;
  RowArgmax argmax;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = i < full ? __mmask16(0xFFFF) : tail_mask(n - full);
    argmax.add(load16(x + i, m), m, i);
  }
  return argmax.result();
}

// SplitMix64 (Steele, Lea & Flood 2014), as sampler.py's _mix64 and _counter_offsets.
constexpr uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ULL, kMixMul1 = 0xBF58476D1CE4E5B9ULL, kMixMul2 = 0x94D049BB133111EBULL;
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * kMixMul1;
  z = (z ^ (z >> 27)) * kMixMul2;
  return z ^ (z >> 31);
}
SS_AVX512 SS_INLINE __m512i mix64x8(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(static_cast<int64_t>(kMixMul1)));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(static_cast<int64_t>(kMixMul2)));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// One row of sampler._sample_random's draw: x = clamp(logits / temperature, +-FLT_MAX), -inf below
// cutoff, minus log(E) for the row's counter-based Exp(1) noise (sampler._log_exponential_noise:
// word w = mix(state + (w + 1) gamma) feeds tokens 2w and 2w + 1, 24 bits each through its little-
// endian int32 halves; u = (bits + 0.5) 2^-24, capped below 1; log(E) = log(-log(u))), then argmax.
template <typename T>
SS_AVX512 int64_t gumbel_argmax_row(const T* __restrict__ x, int64_t n, float temperature, float cutoff, uint64_t state) {
  const int64_t full = n / 16 * 16;
  const __m512 t = _mm512_set1_ps(temperature), c = _mm512_set1_ps(cutoff);
  const __m512 lo = _mm512_set1_ps(-3.4028234663852886e38f), hi = _mm512_set1_ps(3.4028234663852886e38f);
  __m512i words = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(state)),
                                   _mm512_mullo_epi64(_mm512_setr_epi64(1, 2, 3, 4, 5, 6, 7, 8), _mm512_set1_epi64(static_cast<int64_t>(kGoldenGamma))));
  const __m512i next = _mm512_set1_epi64(static_cast<int64_t>(8 * kGoldenGamma));
  RowArgmax argmax;
  for (int64_t i = 0; i < n; i += 16, words = _mm512_add_epi64(words, next)) {
    const __mmask16 m = i < full ? __mmask16(0xFFFF) : tail_mask(n - full);
    // max/min return their second operand when one is NaN: v second, so a NaN stays NaN (torch's clamp).
    __m512 v = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_div_ps(load16(x + i, m), t)));
    v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, c, _CMP_LT_OQ), _mm512_set1_ps(-INFINITY));
    const __m512i bits = _mm512_and_si512(mix64x8(words), _mm512_set1_epi32(0xFFFFFF));
    __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(bits), _mm512_set1_ps(0.5f)), _mm512_set1_ps(0x1p-24f));
    u = _mm512_min_ps(u, _mm512_set1_ps(0x1.fffffep-1f));
    const __m512 log_e = log16(_mm512_sub_ps(_mm512_setzero_ps(), log16(u)));
    argmax.add(_mm512_sub_ps(v, log_e), m, i);
  }
  return argmax.result();
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

// The checks the ops over rows of logits share: AVX-512, [rows, n] bfloat16 or float32 with
// contiguous rows; `indexed`: 1 <= n < 2^31, as RowArgmax's int32 lane indices need.
void check_row_logits(const at::Tensor& x, const char* op, bool indexed) {
  TORCH_CHECK(cpu_has_avx512(), op, " needs an x86-64 CPU with AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && is_kernel_dtype(x.scalar_type()),
              op, ": logits must be [rows, n] bfloat16 or float32 with contiguous rows, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(!indexed || (x.size(1) >= 1 && x.size(1) <= INT32_MAX), op, ": rows must hold 1 to 2^31 - 1 values, got ", x.size(1));
}

// [rows] int64: row_index(row, r) for each row r of x (a pointer to its first value, bfloat16 or
// float), the rows split over torch's threads.
template <typename RowIndex>
at::Tensor index_per_row(const at::Tensor& x, RowIndex&& row_index) {
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t stride = x.stride(0);
  dispatch_kernel_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = row_index(xp + r * stride, r);
    });
  });
  return out;
}

}  // namespace

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, at::IntArrayRef rows) {
  check_row_logits(logits, "apply_token_bitmask_", false);
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

at::Tensor gumbel_argmax(const at::Tensor& logits, const at::Tensor& temperature, const c10::optional<at::Tensor>& cutoff,
                         const at::Tensor& seed, const at::Tensor& step_index) {
  check_row_logits(logits, "gumbel_argmax", true);
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto check_row_vector = [&](const at::Tensor& t, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == rows && t.is_contiguous() && t.scalar_type() == dtype, name, " must be a contiguous [", rows, "] ",
                dtype, ", got ", t.sizes(), " ", t.scalar_type());
  };
  check_row_vector(temperature, at::kFloat, "temperature");
  check_row_vector(seed, at::kLong, "seed");
  check_row_vector(step_index, at::kLong, "step_index");
  if (cutoff) check_row_vector(*cutoff, at::kFloat, "cutoff");
  const float* tp = temperature.const_data_ptr<float>();
  const float* cp = cutoff ? cutoff->const_data_ptr<float>() : nullptr;
  const int64_t* sp = seed.const_data_ptr<int64_t>();
  const int64_t* ip = step_index.const_data_ptr<int64_t>();
  return index_per_row(logits, [&](const auto* row, int64_t r) {
    const uint64_t state = mix64(mix64(static_cast<uint64_t>(sp[r])) ^ static_cast<uint64_t>(ip[r]));
    return gumbel_argmax_row(row, n, tp[r], cp ? cp[r] : -INFINITY, state);
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_row_logits(x, "argmax_rows", true);
  const int64_t n = x.size(1);
  return index_per_row(x, [&](const auto* row, int64_t) { return argmax_row(row, n); });
}

}  // namespace stageserve
