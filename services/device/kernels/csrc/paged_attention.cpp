// Paged decode attention: one query token per row, keys and values read in place from the paged KV
// pool (no gather copy), fp32 scores, exact max-subtracted softmax, fp32 accumulation.
//
// The algorithm is vLLM's CPU paged attention (csrc/cpu/attention.cpp; Kwon et al. 2023): one task
// per (row, kv head), in which the group of query heads sharing that kv head computes all its
// scores, the softmax, then the weighted sum of values; each key/value row is loaded once per group.
// With a sliding window of W tokens a row attends only to its last W tokens (positions context - W
// .. context - 1, transformers' sliding_window_overlay): the tokens before are skipped, not masked.
// With a soft cap C (Gemma 2) each scaled score s becomes C * tanh(s / C) before the softmax, in one
// more pass over the scores that uncapped models skip.

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <memory>
#include <type_traits>

namespace stageserve {

namespace {

SS_INLINE void prefetch_block(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

// Tokens whose key and value rows are requested ahead of use: the rows are scattered over the pool,
// out of the hardware prefetcher's sight. Two chunks of 16 measured best on a 2-core Xeon (16: ~5 %
// slower; 48: the same).
constexpr int64_t kPrefetchAhead = 32;

// Requests the key and value rows of tokens [begin, end).
template <typename T>
SS_INLINE void prefetch_rows(const T* k_pool, const T* v_pool, const int64_t* offsets, int64_t begin, int64_t end, int64_t row_bytes) {
  for (int64_t t = begin; t < end; ++t) {
    prefetch_block(k_pool + offsets[t], row_bytes);
    prefetch_block(v_pool + offsets[t], row_bytes);
  }
}

// s[0, n) = cap * tanh(s / cap), in place.
SS_AVX512 SS_INLINE void soft_cap(float* __restrict__ s, int64_t n, float cap) {
  const __m512 cap_v = _mm512_set1_ps(cap), inv_cap = _mm512_set1_ps(1.0f / cap);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 m = tail_mask(std::min<int64_t>(16, n - t));
    _mm512_mask_storeu_ps(s + t, m, _mm512_mul_ps(cap_v, tanh16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), inv_cap))));
  }
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

// r[j] = the sum of v[j]'s 16 lanes, for 16 vectors at once: a transpose-and-add tree (45 shuffles
// and adds) instead of 16 separate horizontal reductions (~8 dependent operations each).
SS_AVX512 SS_INLINE __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v2i, v2i+1, v2i, v2i+1] partial sums
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [v4i, v4i+1, v4i+2, v4i+3] partial sums
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: [b2i lanes 0+1, b2i lanes 2+3, b2i+1 lanes 0+1, b2i+1 lanes 2+3]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// One query head's scores against 16 key rows: the dot products summed by sum_lanes16. `set` takes
// the head's D query values. float32, or bfloat16 widened to fp32: D / 16 FMAs per key row.
template <typename T, int D>
struct FmaDot {
  __m512 q[D / 16];
  SS_AVX512 SS_INLINE void set(const T* p) {
    for (int c = 0; c < D / 16; ++c) q[c] = load16(p + 16 * c);
  }
  SS_AVX512 SS_INLINE __m512 scores16(const T* const (&rows)[16]) const {
    __m512 d[16];
    for (int i = 0; i < 16; ++i) {
      d[i] = _mm512_mul_ps(q[0], load16(rows[i]));
      for (int c = 1; c < D / 16; ++c) d[i] = _mm512_fmadd_ps(q[c], load16(rows[i] + 16 * c), d[i]);
    }
    return sum_lanes16(d);
  }
};

#if defined(SS_HAVE_AVX512_BF16)
// bfloat16 on CPUs with AVX512-BF16: D / 32 VDPBF16PS per key row over the raw bf16 values (no
// widening; a product of two bf16 values is exact in fp32, the sums are fp32). Not inlined into the
// AVX-512 caller (GCC does not inline across a wider target), hence 16 rows per call.
template <int D>
struct Bf16Dot {
  __m512i q[D / 32];
  SS_AVX512 SS_INLINE void set(const c10::BFloat16* p) {
    for (int c = 0; c < D / 32; ++c) q[c] = _mm512_loadu_si512(p + 32 * c);
  }
  SS_AVX512_BF16 __m512 scores16(const c10::BFloat16* const (&rows)[16]) const {
    __m512 d[16];
    for (int i = 0; i < 16; ++i) {
      d[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q[0], (__m512bh)_mm512_loadu_si512(rows[i]));
      for (int c = 1; c < D / 32; ++c) d[i] = _mm512_dpbf16_ps(d[i], (__m512bh)q[c], (__m512bh)_mm512_loadu_si512(rows[i] + 32 * c));
    }
    return sum_lanes16(d);
  }
};
#endif

// One (row, kv head): the G query heads q[g * q_head_stride, + D) over the row's tokens [first,
// end), whose keys/values are rows of k_pool/v_pool ([num_blocks, block_size, D]) at the block
// table's blocks. Writes out[G * D]. `scores` holds G * (end - first) floats, `offsets` end - first
// entries. Keys go 16 tokens at a time (16 scores per head from one sum_lanes16); the key and value
// rows kPrefetchAhead tokens on are requested meanwhile, so the values are in cache after the softmax.
template <typename T, int D, int G, typename Dot>
SS_AVX512 void attend(const T* __restrict__ q, int64_t q_head_stride, const T* __restrict__ k_pool,
                      const T* __restrict__ v_pool, const int64_t* __restrict__ table, int64_t first, int64_t end,
                      int64_t block_size, float scale, float softcap, T* __restrict__ out, float* __restrict__ scores,
                      int64_t* __restrict__ offsets) {
  constexpr int64_t kRowBytes = D * sizeof(T);
  const int64_t context = end - first;  // the tokens attended to; below, token t is the row's token first + t
  for (int64_t j = first / block_size; j * block_size < end; ++j)  // each token's row offset in the pool, once
    for (int64_t p = std::max(first, j * block_size), base = table[j] * block_size * D; p < std::min((j + 1) * block_size, end); ++p)
      offsets[p - first] = base + (p - j * block_size) * D;
  Dot dots[G];
  for (int g = 0; g < G; ++g) dots[g].set(q + g * q_head_stride);
  const __m512 scale_v = _mm512_set1_ps(scale);
  prefetch_rows(k_pool, v_pool, offsets, 0, std::min(kPrefetchAhead, context), kRowBytes);
  for (int64_t t0 = 0; t0 < context; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, context - t0);
    prefetch_rows(k_pool, v_pool, offsets, t0 + kPrefetchAhead, std::min(t0 + kPrefetchAhead + 16, context), kRowBytes);
    const T* rows[16];
    for (int64_t i = 0; i < 16; ++i) rows[i] = k_pool + offsets[t0 + std::min(i, n - 1)];  // a short chunk repeats its last row; masked below
    for (int g = 0; g < G; ++g)
      _mm512_mask_storeu_ps(scores + g * context + t0, tail_mask(n), _mm512_mul_ps(dots[g].scores16(rows), scale_v));
  }
  if (softcap > 0) soft_cap(scores, G * context, softcap);
  for (int g = 0; g < G; ++g) softmax(scores + g * context, context);
  constexpr int C = D / 16;
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < context; ++t) {
    const T* row = v_pool + offsets[t];
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(row + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * context + t]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) store16(out + g * D + 16 * c, acc[g][c]);
}

// The first token a row of `context` tokens attends to: 0 without a window (window 0).
SS_INLINE int64_t first_token(int64_t context, int64_t window) { return window > 0 ? std::max<int64_t>(0, context - window) : 0; }

template <typename T>
using Kernel = void (*)(const T*, int64_t, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, float, float, T*, float*, int64_t*);

template <typename T, int D, typename Dot>
Kernel<T> kernel_for_group(int64_t group) {
  switch (group) {  // query heads per kv head in common models (1 = multi-head attention); supported() keeps to these
    case 1: return attend<T, D, 1, Dot>;
    case 2: return attend<T, D, 2, Dot>;
    case 3: return attend<T, D, 3, Dot>;
    case 4: return attend<T, D, 4, Dot>;
    case 5: return attend<T, D, 5, Dot>;
    case 6: return attend<T, D, 6, Dot>;
    case 7: return attend<T, D, 7, Dot>;
    default: return attend<T, D, 8, Dot>;
  }
}

template <typename T, int D>
Kernel<T> kernel_for(int64_t group) {
#if defined(SS_HAVE_AVX512_BF16)
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    if (cpu_has_avx512_bf16()) return kernel_for_group<T, D, Bf16Dot<D>>(group);
#endif
  return kernel_for_group<T, D, FmaDot<T, D>>(group);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t window,
         double softcap, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t K = kv.size(0) / 2, N = kv.size(1), block_size = kv.size(2), W = tables.size(1), G = H / K;
  const Kernel<T> kernel = D == 64 ? kernel_for<T, 64>(G) : kernel_for<T, 128>(G);
  const T* qp = q.const_data_ptr<T>();
  const T* kvp = kv.const_data_ptr<T>();
  const int64_t* tab = tables.const_data_ptr<int64_t>();
  const int64_t* len = lens.const_data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t max_context = window > 0 ? std::min(window, *std::max_element(len, len + B)) : *std::max_element(len, len + B);
  // One task a chunk (parallel_chunks): a thread another process delays leaves its tasks to the others.
  parallel_chunks(B * K, 1, [&](int64_t begin, int64_t end) {
    // Uninitialised: every score and offset is written before it is read.
    const std::unique_ptr<float[]> scores(new float[G * max_context]);
    const std::unique_ptr<int64_t[]> offsets(new int64_t[max_context]);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / K, h = i % K;
      kernel(qp + b * q.stride(0) + h * G * q.stride(1), q.stride(1), kvp + h * N * block_size * D,
             kvp + (K + h) * N * block_size * D, tab + b * W, first_token(len[b], window), len[b], block_size, static_cast<float>(scale),
             static_cast<float>(softcap), op + b * H * D + h * G * D, scores.get(), offsets.get());
    }
  });
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t window, double softcap) {
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
  TORCH_CHECK(window >= 0, "window must be a number of tokens, or 0 for none, got ", window);
  TORCH_CHECK(softcap >= 0, "softcap must be positive, or 0 for none, got ", softcap);
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 && context_lens.is_contiguous() &&
                  context_lens.size(0) == q.size(0),
              "context_lens must be contiguous int64 [rows]");
  const int64_t B = q.size(0), W = block_tables.size(1), N = kv.size(1), block_size = kv.size(2);
  const int64_t* len = context_lens.const_data_ptr<int64_t>();
  const int64_t* tab = block_tables.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {  // bounds once here, so the parallel loop cannot read outside the pool
    TORCH_CHECK(len[b] >= 1 && len[b] <= W * block_size, "row ", b, ": context ", len[b], " outside 1..", W * block_size);
    for (int64_t j = first_token(len[b], window) / block_size; j < (len[b] + block_size - 1) / block_size; ++j)  // the blocks read
      TORCH_CHECK(tab[b * W + j] >= 0 && tab[b * W + j] < N, "row ", b, ": block id ", tab[b * W + j], " outside the pool");
  }
  at::Tensor out = at::empty({B, q.size(1) * q.size(2)}, q.options());
  if (B == 0) return out;
  dispatch_kernel_dtype(q.scalar_type(), [&](auto tag) { run<decltype(tag)>(q, kv, block_tables, context_lens, scale, window, softcap, out); });
  return out;
}

}  // namespace stageserve
