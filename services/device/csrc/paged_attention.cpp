// Paged decode attention: one query token per row, keys and values read in place from the paged KV
// pool (no gather copy), fp32 scores, exact max-subtracted softmax, fp32 accumulation.
//
// The algorithm is vLLM's CPU paged attention (csrc/cpu/attention.cpp; Kwon et al. 2023): one task
// per (row, kv head), in which the group of query heads sharing that kv head computes all its
// scores, the softmax, then the weighted sum of values; each key/value row is loaded once per group.

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <memory>

namespace stageserve {

#if defined(__x86_64__)
namespace {

SS_INLINE void prefetch_block(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// In-place softmax of s[0, n), n >= 1.
SS_AVX512 SS_INLINE void softmax(float* __restrict__ s, int64_t n) {
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = tail_mask(n - full);
  __m512 m = _mm512_set1_ps(s[0]);
  for (int64_t t = 0; t < full; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + full));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < full; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), max));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), max)));
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
  const int64_t blocks = (context + block_size - 1) / block_size;
  prefetch_block(k_pool + table[0] * block_size * D, block_size * D * sizeof(T));
  for (int64_t t0 = 0, j = 0; t0 < context; t0 += block_size, ++j) {
    const T* block = k_pool + table[j] * block_size * D;
    const int64_t n = std::min(block_size, context - t0);
    // The next block (or the first value block) is scattered elsewhere in the pool, out of the
    // hardware prefetcher's sight: ask for it while this one is computed.
    prefetch_block(j + 1 < blocks ? k_pool + table[j + 1] * block_size * D : v_pool + table[0] * block_size * D, block_size * D * sizeof(T));
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
    if (j + 1 < blocks) prefetch_block(v_pool + table[j + 1] * block_size * D, block_size * D * sizeof(T));
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
  switch (group) {  // query heads per kv head in common models (1 = multi-head attention); supported() keeps to these
    case 1: return attend<T, D, 1>;
    case 2: return attend<T, D, 2>;
    case 3: return attend<T, D, 3>;
    case 4: return attend<T, D, 4>;
    case 5: return attend<T, D, 5>;
    case 6: return attend<T, D, 6>;
    case 7: return attend<T, D, 7>;
    default: return attend<T, D, 8>;
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables, const at::Tensor& lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t K = kv.size(0) / 2, N = kv.size(1), block_size = kv.size(2), W = tables.size(1), G = H / K;
  const Kernel<T> kernel = D == 64 ? kernel_for_group<T, 64>(G) : kernel_for_group<T, 128>(G);
  const T* qp = q.const_data_ptr<T>();
  const T* kvp = kv.const_data_ptr<T>();
  const int64_t* tab = tables.const_data_ptr<int64_t>();
  const int64_t* len = lens.const_data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t max_context = *std::max_element(len, len + B);
  // Tasks are taken one at a time from a shared counter rather than split in equal halves up front:
  // when another process takes a core for a while, the other thread does the remaining tasks
  // instead of waiting for it at the end of the loop.
  std::atomic<int64_t> next{0};
  const int64_t tasks = B * K;
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), tasks), 1, [&](int64_t, int64_t) {
    const std::unique_ptr<float[]> scores(new float[G * max_context]);  // every score is written before it is read
    for (int64_t i = next.fetch_add(1); i < tasks; i = next.fetch_add(1)) {
      const int64_t b = i / K, h = i % K;
      kernel(qp + b * q.stride(0) + h * G * q.stride(1), q.stride(1), kvp + h * N * block_size * D,
             kvp + (K + h) * N * block_size * D, tab + b * W, len[b], block_size, static_cast<float>(scale),
             op + b * H * D + h * G * D, scores.get());
    }
  });
}

}  // namespace
#endif

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [rows, heads, head_dim] with contiguous head_dim, got ", q.sizes());
  TORCH_CHECK(kv.dim() == 4 && kv.is_contiguous() && kv.size(0) >= 2 && kv.size(0) % 2 == 0 && kv.size(3) == q.size(2),
              "kv must be a contiguous layer pool [2 * kv_heads, blocks, block_size, head_dim], got ", kv.sizes());
  TORCH_CHECK(kv.scalar_type() == q.scalar_type(), "q and kv dtypes differ");
  const int64_t K = kv.size(0) / 2;
  TORCH_CHECK(q.size(1) % K == 0, "query heads (", q.size(1), ") must be a multiple of kv heads (", K, ")");
  TORCH_CHECK(supported(q.scalar_type(), q.size(2), q.size(1) / K), "no kernel for ", q.scalar_type(), " head_dim ",
              q.size(2), " group ", q.size(1) / K, " on this CPU (check supported first)");
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
#if defined(__x86_64__)
  if (B == 0) return out;
  if (q.scalar_type() == at::kBFloat16) run<c10::BFloat16>(q, kv, block_tables, context_lens, scale, out);
  else run<float>(q, kv, block_tables, context_lens, scale, out);
#endif
  return out;
}

}  // namespace stageserve
