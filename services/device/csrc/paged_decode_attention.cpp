// Paged decode attention for x86 CPUs with AVX-512: one query token per row, keys and values read
// straight from the paged KV pool (no gather copy), fp32 accumulation, exact softmax.
//
// Registered as torch.ops.stageserve.paged_decode_attention / paged_decode_attention_supported and
// built on first use by stageserve.device.cpu_kernels. The algorithm is vLLM's CPU paged attention
// (csrc/cpu/attention.cpp, Kwon et al. 2023): per (row, kv head) task, the group of query heads
// that share the kv head computes all scores, an exact max-subtracted softmax, then sums the values;
// here each key/value row is loaded once for the whole query group.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define SS_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))
#define SS_INLINE inline __attribute__((always_inline))

namespace {

// 16 elements <-> one fp32 vector. bf16 is the top half of an fp32; stores round to nearest even.
SS_AVX512 SS_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SS_AVX512 SS_INLINE __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
SS_AVX512 SS_INLINE void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
SS_AVX512 SS_INLINE void store16(c10::BFloat16* p, __m512 x) {
  __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}

// exp(x) for x <= 0 (scores after subtracting their max): x = n ln2 + r, degree-6 Taylor
// polynomial for e^r (|r| <= ln2 / 2, relative error < 2e-7), times 2^n by scalef.
SS_AVX512 SS_INLINE __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 split in two for precision
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// In-place softmax of s[0, n); returns nothing, s holds probabilities.
SS_AVX512 SS_INLINE void softmax(float* __restrict__ s, int64_t n) {
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1);
  __m512 m = _mm512_set1_ps(s[0]);
  for (int64_t t = 0; t < full; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + full));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < full; t += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), max));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), max)));
  _mm512_mask_storeu_ps(s + full, tail, e);
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_add_ps(sum, e)));
  for (int64_t t = 0; t < full; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
  _mm512_mask_storeu_ps(s + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + full), inv));
}

// One (row, kv head): the G query heads q[g * q_head_stride, + D) over the row's `context` tokens,
// whose keys/values are rows of k_pool/v_pool ([num_blocks, block_size, D]) at the block table's
// blocks. Writes out[G * D]. `scores` holds G * context floats.
template <typename T, int D, int G>
SS_AVX512 void attend(const T* __restrict__ q, int64_t q_head_stride, const T* __restrict__ k_pool,
                      const T* __restrict__ v_pool, const int64_t* __restrict__ table, int64_t context,
                      int64_t block_size, float scale, T* __restrict__ out, float* __restrict__ scores) {
  constexpr int C = D / 16;
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_mul_ps(load16(q + g * q_head_stride + 16 * c), _mm512_set1_ps(scale));
  for (int64_t t0 = 0, j = 0; t0 < context; t0 += block_size, ++j) {
    const T* block = k_pool + table[j] * block_size * D;
    const int64_t n = std::min(block_size, context - t0);
    for (int64_t o = 0; o < n; ++o) {
      __m512 k[C];
      for (int c = 0; c < C; ++c) k[c] = load16(block + o * D + 16 * c);
      for (int g = 0; g < G; ++g) {
        __m512 dot = _mm512_mul_ps(qv[g][0], k[0]);
        for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(qv[g][c], k[c], dot);
        scores[g * context + t0 + o] = _mm512_reduce_add_ps(dot);
      }
    }
  }
  for (int g = 0; g < G; ++g) softmax(scores + g * context, context);
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t0 = 0, j = 0; t0 < context; t0 += block_size, ++j) {
    const T* block = v_pool + table[j] * block_size * D;
    const int64_t n = std::min(block_size, context - t0);
    for (int64_t o = 0; o < n; ++o) {
      __m512 v[C];
      for (int c = 0; c < C; ++c) v[c] = load16(block + o * D + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * context + t0 + o]);
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store16(out + g * D + 16 * c, acc[g][c]);
}

template <typename T>
using Kernel = void (*)(const T*, int64_t, const T*, const T*, const int64_t*, int64_t, int64_t, float, T*, float*);

template <typename T, int D>
Kernel<T> kernel_for_group(int64_t group) {
  switch (group) {  // the query heads per kv head of common models (1 = multi-head attention)
    case 1: return attend<T, D, 1>;
    case 2: return attend<T, D, 2>;
    case 3: return attend<T, D, 3>;
    case 4: return attend<T, D, 4>;
    case 5: return attend<T, D, 5>;
    case 6: return attend<T, D, 6>;
    case 7: return attend<T, D, 7>;
    case 8: return attend<T, D, 8>;
    default: return nullptr;
  }
}

template <typename T>
Kernel<T> kernel_for(int64_t head_dim, int64_t group) {
  static const bool cpu_ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("fma");
  if (!cpu_ok) return nullptr;
  if (head_dim == 64) return kernel_for_group<T, 64>(group);
  if (head_dim == 128) return kernel_for_group<T, 128>(group);
  return nullptr;
}

bool supported(c10::ScalarType dtype, int64_t head_dim, int64_t group) {
  if (dtype == at::kBFloat16) return kernel_for<c10::BFloat16>(head_dim, group) != nullptr;
  if (dtype == at::kFloat) return kernel_for<float>(head_dim, group) != nullptr;
  return false;
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables, const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t K = kv.size(0) / 2, N = kv.size(1), block_size = kv.size(2), W = tables.size(1), G = H / K;
  const Kernel<T> kernel = kernel_for<T>(D, G);
  const T* qp = q.const_data_ptr<T>();
  const T* kvp = kv.const_data_ptr<T>();
  const int64_t* tab = tables.const_data_ptr<int64_t>();
  const int64_t* len = lens.const_data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t max_context = *std::max_element(len, len + B);
  at::parallel_for(0, B * K, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * max_context);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / K, h = i % K;
      kernel(qp + b * q.stride(0) + h * G * q.stride(1), q.stride(1), kvp + h * N * block_size * D,
             kvp + (K + h) * N * block_size * D, tab + b * W, len[b], block_size, static_cast<float>(scale),
             op + b * H * D + h * G * D, scores.data());
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [rows, heads, head_dim] with contiguous head_dim, got ", q.sizes());
  TORCH_CHECK(kv.dim() == 4 && kv.is_contiguous() && kv.size(0) % 2 == 0 && kv.size(3) == q.size(2),
              "kv must be a contiguous layer pool [2 * kv_heads, blocks, block_size, head_dim], got ", kv.sizes());
  TORCH_CHECK(kv.scalar_type() == q.scalar_type(), "q and kv dtypes differ");
  const int64_t K = kv.size(0) / 2;
  TORCH_CHECK(q.size(1) % K == 0, "query heads (", q.size(1), ") must be a multiple of kv heads (", K, ")");
  TORCH_CHECK(supported(q.scalar_type(), q.size(2), q.size(1) / K), "no kernel for ", q.scalar_type(), " head_dim ",
              q.size(2), " group ", q.size(1) / K, " on this CPU (check paged_decode_attention_supported first)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  block_tables.size(0) == q.size(0),
              "block_tables must be contiguous int64 [rows, blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 && context_lens.is_contiguous() &&
                  context_lens.size(0) == q.size(0),
              "context_lens must be contiguous int64 [rows]");
  const int64_t B = q.size(0), W = block_tables.size(1), N = kv.size(1), block_size = kv.size(2);
  const int64_t* len = context_lens.const_data_ptr<int64_t>();
  const int64_t* tab = block_tables.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // bounds once here, so the parallel loop cannot read outside the pool
    TORCH_CHECK(len[b] >= 1 && len[b] <= W * block_size, "row ", b, ": context ", len[b], " outside 1..", W * block_size);
    for (int64_t j = 0; j < (len[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(tab[b * W + j] >= 0 && tab[b * W + j] < N, "row ", b, ": block id ", tab[b * W + j], " outside the pool");
  }
  at::Tensor out = at::empty({B, q.size(1) * q.size(2)}, q.options());
  if (B == 0) return out;
  if (q.scalar_type() == at::kBFloat16) run<c10::BFloat16>(q, kv, block_tables, context_lens, scale, out);
  else run<float>(q, kv, block_tables, context_lens, scale, out);
  return out;
}

}  // namespace

#else  // not x86-64: the op exists and says it is unsupported; callers keep their torch path.

namespace {
bool supported(c10::ScalarType, int64_t, int64_t) { return false; }
at::Tensor paged_decode_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "paged_decode_attention needs an x86-64 CPU with AVX-512");
}
}  // namespace

#endif

TORCH_LIBRARY(stageserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
  m.def("paged_decode_attention_supported(ScalarType dtype, int head_dim, int group) -> bool", &supported);
}
TORCH_LIBRARY_IMPL(stageserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
