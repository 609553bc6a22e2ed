// Helpers shared by the ops: the dtypes they take and the dispatch over them, how a loop splits over
// threads, and the AVX-512 vector helpers (16 elements, bfloat16 or float32, <-> one fp32
// vector; exp, silu). Every vector function carries the target attribute, so the library is built
// with the compiler's default flags and loads on any x86-64 CPU; the ops check the CPU before
// calling into these.
#pragma once

// cpu_kernels.py builds this library only on x86-64 (elsewhere the model runs plain torch ops).
#if !defined(__x86_64__)
#error "the stageserve CPU kernels are x86-64 only"
#endif

#include <ATen/Parallel.h>
#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#define SS_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))
// Compilers too old for the AVX512-BF16 (GCC < 10) or AMX (GCC < 11) intrinsics build the library
// without the variants that use them, rather than failing the whole build.
#if __has_include(<avx512bf16intrin.h>)
#define SS_HAVE_AVX512_BF16 1
#define SS_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,avx512bf16")))
#endif
#if defined(SS_HAVE_AVX512_BF16) && __has_include(<amxtileintrin.h>) && __has_include(<amxbf16intrin.h>)
#define SS_HAVE_AMX 1
#endif
#define SS_INLINE inline __attribute__((always_inline))

namespace stageserve {

// The dtypes every op but the bfloat16-only amx_* ones takes.
inline bool is_kernel_dtype(c10::ScalarType dtype) { return dtype == c10::kBFloat16 || dtype == c10::kFloat; }

// Calls fn(T{}) with T the element type of `dtype`: c10::BFloat16 for bfloat16, else float (the
// caller has checked is_kernel_dtype).
template <typename Fn>
void dispatch_kernel_dtype(c10::ScalarType dtype, Fn&& fn) {
  if (dtype == c10::kBFloat16) fn(c10::BFloat16{});
  else fn(float{});
}

// at::parallel_for's grain for a loop over rows of `row_values` values each: ~16K values per thread
// at least, so a decode step's 32 rows split over two threads while a few rows stay on one (the
// thread hand-off costs more than they take). Measured on a 2-core Xeon, 32 rows: rms_norm's 59 calls
// 750 -> 540 us per step, rope_and_cache 790 -> 525 us, silu_and_mul of a 1536-wide MLP 22 -> 16 us.
inline int64_t rows_per_thread(int64_t row_values) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_values, 1)); }

// Calls fn(begin, end) over [0, total) in chunks of `grain` that the threads take one at a time from a
// shared counter, rather than in equal parts fixed up front (at::parallel_for): when another process
// or thread takes a core for a while, the other threads do its remaining chunks instead of waiting for
// it at the end of the loop. Served on two cores, the pipeline's host threads preempt a compute thread
// ~12 % of the time. fn may run on any thread, for any chunks; one chunk or one thread: the caller's.
template <typename Fn>
void parallel_chunks(int64_t total, int64_t grain, const Fn& fn) {
  const int64_t chunks = (total + grain - 1) / grain, threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    if (total > 0) fn(0, total);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) fn(c * grain, std::min(total, (c + 1) * grain));
  });
}

bool cpu_has_avx512();
bool cpu_has_avx512_bf16();  // AVX512-BF16 (VDPBF16PS, VCVTNEPS2BF16): the bf16 paths that have a variant using it

SS_AVX512 SS_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SS_AVX512 SS_INLINE __m512 load16(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
SS_AVX512 SS_INLINE __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
SS_AVX512 SS_INLINE __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
SS_AVX512 SS_INLINE __m256i to_bf16_bits(__m512 x) {  // round to nearest even; NaN -> quiet NaN (as c10)
  __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  bits = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), bits, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(bits);
}
SS_AVX512 SS_INLINE void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
SS_AVX512 SS_INLINE void store16(c10::BFloat16* p, __m512 x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(x)); }
SS_AVX512 SS_INLINE void store16(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
SS_AVX512 SS_INLINE void store16(c10::BFloat16* p, __m512 x, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, to_bf16_bits(x)); }

SS_INLINE __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1); }  // n in [0, 16]

// exp(x), x clamped to [-87, 88] (fp32's range; NaN stays NaN): x = n ln2 + r, degree-6 Taylor polynomial for e^r
// (|r| <= ln2 / 2, relative error < 2e-7), times 2^n by scalef.
SS_AVX512 SS_INLINE __m512 exp16(__m512 x) {
  // max/min return their second operand when one is NaN: x second, so a NaN stays NaN (as in torch).
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), _mm512_max_ps(_mm512_set1_ps(-87.0f), x));
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

// log(x) for positive normal x (Cephes' logf: x = m 2^e with m in [sqrt(1/2), sqrt(2)), a degree-9
// polynomial in m - 1; relative error ~1e-7, within an ulp or two of torch's).
// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: no overflow for any x; absolute
// error ~1e-7 (the cancellation in 1 - e near 0 costs relative, not absolute, accuracy).
SS_AVX512 SS_INLINE __m512 tanh16(__m512 x) {
  const __m512 sign_bit = _mm512_set1_ps(-0.0f);
  const __m512 e = exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_andnot_ps(sign_bit, x)));
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return _mm512_or_ps(t, _mm512_and_ps(sign_bit, x));
}

SS_AVX512 SS_INLINE __m512 log16(__m512 x) {
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);  // [1, 2)
  __m512 e = _mm512_getexp_ps(x);
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0f));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f)), z = _mm512_mul_ps(f, f);
  __m512 y = _mm512_set1_ps(7.0376836292e-2f);
  for (const float c : {-1.1514610310e-1f, 1.1676998740e-1f, -1.2420140846e-1f, 1.4249322787e-1f, -1.6668057665e-1f,
                        2.0000714765e-1f, -2.4999993993e-1f, 3.3333331174e-1f})
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(c));
  y = _mm512_mul_ps(_mm512_mul_ps(y, f), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), z, y);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(f, y));
}

// silu(g) = g / (1 + e^-g). The reciprocal by rcp14 (relative error < 2^-14), refined by one Newton
// step (~1e-8) where the result is float32; a fraction of a vector division's cost either way.
template <bool kNewton>
SS_AVX512 SS_INLINE __m512 silu16(__m512 g) {
  const __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  __m512 inv = _mm512_rcp14_ps(denom);
  if constexpr (kNewton) inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(denom, inv, _mm512_set1_ps(2.0f)));
  return _mm512_mul_ps(g, inv);
}

}  // namespace stageserve
