// RMSNorm (Zhang & Sennrich 2019) over the last dimension, optionally after adding a delta into the
// residual stream in place (vLLM's fused_add_rms_norm): one pass over the row instead of the
// separate add, square, mean, rsqrt, multiply and dtype conversions of the torch path. And the
// per-head RMSNorm of queries and keys before RoPE (Qwen3's and Gemma 3's q_norm / k_norm) in place
// in the fused qkv projection: one call a layer where the torch path takes two norms of ~8 ops each.

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cmath>

namespace stageserve {

namespace {

// out = x / sqrt(mean(x^2) + eps) * weight for one row of n elements, in fp32, rounded once to T.
// With `delta`, x = residual + delta is first rounded to T and stored back into `residual`
// (as the torch path's residual stream holds it). `out` may be `residual` (in place, without delta):
// each element is read before it is written, so neither pointer is restrict.
template <typename T>
SS_AVX512 void norm_row(T* residual, const T* __restrict__ delta, const T* __restrict__ weight,
                        T* out, int64_t n, float eps) {
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = tail_mask(n - full);
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = i < full ? __mmask16(0xFFFF) : tail;
    __m512 x = load16(residual + i, m);
    if (delta != nullptr) {
      store16(residual + i, _mm512_add_ps(x, load16(delta + i, m)), m);
      x = load16(residual + i, m);  // the rounded sum, as stored
    }
    squares = _mm512_fmadd_ps(x, x, squares);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / n + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = i < full ? __mmask16(0xFFFF) : tail;
    store16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(residual + i, m), inv), load16(weight + i, m)), m);
  }
}

at::Tensor norm(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps) {
  TORCH_CHECK(cpu_has_avx512(), "rms_norm needs an x86-64 CPU with AVX-512");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && is_kernel_dtype(x.scalar_type()),
              "x must be contiguous [tokens, hidden] bfloat16 or float32, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [hidden] of x's dtype");
  if (delta != nullptr)
    TORCH_CHECK(delta->sizes() == x.sizes() && delta->is_contiguous() && delta->scalar_type() == x.scalar_type(),
                "delta must be contiguous, with residual's shape and dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch_kernel_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* xp = static_cast<T*>(x.data_ptr());  // written only with a delta (add_rms_norm's residual)
    const T* dp = delta ? delta->const_data_ptr<T>() : nullptr;
    at::parallel_for(0, rows, rows_per_thread(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        norm_row<T>(xp + r * n, dp ? dp + r * n : nullptr, weight.const_data_ptr<T>(), out.data_ptr<T>() + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

}  // namespace

void rms_norm_heads_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, int64_t heads, int64_t kv_heads, double eps) {
  TORCH_CHECK(cpu_has_avx512(), "rms_norm_heads_ needs an x86-64 CPU with AVX-512");
  TORCH_CHECK(q_weight.dim() == 1 && q_weight.is_contiguous() && k_weight.sizes() == q_weight.sizes() && k_weight.is_contiguous() &&
                  q_weight.scalar_type() == qkv.scalar_type() && k_weight.scalar_type() == qkv.scalar_type(),
              "q_weight and k_weight must be contiguous [head_dim] of qkv's dtype");
  const int64_t d = q_weight.size(0), normed = heads + kv_heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && is_kernel_dtype(qkv.scalar_type()) && heads > 0 && kv_heads > 0 &&
                  qkv.size(1) == (heads + 2 * kv_heads) * d,
              "qkv must be contiguous [tokens, (heads + 2 kv_heads) head_dim] bfloat16 or float32, got ", qkv.sizes(), " ",
              qkv.scalar_type(), " for ", heads, " + 2 x ", kv_heads, " heads of ", d);
  const int64_t rows = qkv.size(0), n = qkv.size(1);
  dispatch_kernel_dtype(qkv.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* base = static_cast<T*>(qkv.data_ptr());
    const T* qw = q_weight.const_data_ptr<T>();
    const T* kw = k_weight.const_data_ptr<T>();
    at::parallel_for(0, rows * normed, rows_per_thread(d), [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const int64_t head = u % normed;
        T* row = base + (u / normed) * n + head * d;
        norm_row<T>(row, nullptr, head < heads ? qw : kw, row, d, static_cast<float>(eps));
      }
    });
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return norm(x, nullptr, weight, eps); }
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return norm(residual, &delta, weight, eps);
}

}  // namespace stageserve
