// Weight-only quantized linear for inputs of a few rows: 4- or 8-bit weights in groups of 32 along K
// (w = d * q + m per group, d and m float16) times activations quantized per row to int8 in groups of
// 32 (x ~ s * p, s = max |x| / 127), the integer dot products on AVX512-VNNI (VPDPBUSD: 64 u8 x s8
// products per instruction). This is llama.cpp's scheme for Q4_0/Q4_1/Q8_0 x Q8_0/Q8_1 (ggml-quants.c,
// ggml_vec_dot_q4_1_q8_1): per group, sum_k w_k x_k = s (d * sum_k q_k p_k + m * sum_k p_k).
// input_bits = 16 adds a second int8 level for what the first leaves: x rounded to a 257th of that
// step, x ~ s (256 p + p') with s = max |x| / 32639 (32639 = 256 * 127 + 127), both p and p' int8, an
// error of at most max |x| / 65278 (the previous second level, s' = max |x - s p| / 127, gave at most
// max |x| / 64516). The levels' dots are combined per group in int32 (256 * sum q p + sum q p'), so the
// float work (one conversion, two FMAs per group) is per input row, not per int8 row, and all of a
// call's rows (up to 8, `VNNI_MAX_ROWS`) share one pass over each panel, unpacking it
// once. Against two levels summed in float in passes of 4 int8 rows (docs/benchmarks.md, thread CPU
// time on one thread): the embedded model's 120 layer linears take 0.80 / 0.73 / 0.75 of the time at
// 4 / 6 / 8 rows, the same at 1.
//
// Layout (quant_linear.py `VnniKernel` packs it): the weight in panels of 16 output rows, each panel's
// groups of 32 inputs consecutive; within a group, 64-byte chunks holding 4 inputs of each of the 16 rows
// (byte 4 i + j = row i, input j), i.e. one VPDPBUSD operand per chunk with the row in the int32 lane.
// 4-bit: chunk c (of 4) holds inputs 8c..8c+3 in its low nibbles, 8c+4..8c+7 in its high ones. 8-bit:
// chunk c (of 8) holds inputs 4c..4c+3 as q + 128 (unsigned; m = -128 d restores the sign). Scales:
// per panel and group, 16 d then 16 m (float16). Every lane sums its own row, so there is no
// horizontal reduction; a thread takes whole panels.

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <vector>

#define SS_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,avx512vnni,f16c")))

namespace stageserve {

bool cpu_has_avx512_vnni() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return has;
}

namespace {

constexpr int64_t kGroup = 32;     // inputs per scale
constexpr int64_t kLanes = 16;     // output rows per panel (one per int32 lane)
// Input rows sharing one pass over a panel (up to `VNNI_MAX_ROWS`, so a call unpacks each panel once):
// a row holds one int32 sum per level and a float one, 24 of the 32 zmm registers at two levels.
// Against passes of 4 (thread CPU time, 1 thread, interleaved): 2 levels, 6 / 8 rows, 0.84 / 0.93 of
// the time; 1 level 0.89 / 0.92.
constexpr int kPassRows = 8;
// How far ahead of the weight stream to prefetch into L1: the hardware prefetcher alone streamed ~9 GB/s;
// a cold one-row pass over the model's 120 layer linears (benchmarks/quant_linears.py, one input level,
// 2-core Intel Xeon with AMX) went from 5.9 to 3.3 ms with it.
constexpr int64_t kPrefetchBytes = 8192;

// The activation rows as int8 groups, group-major so that a pass addresses its rows at fixed offsets
// from one pointer: p [K / 32, levels * M, 32] (row r's level l at levels * r + l); per group and row
// the integer v = p (one level) or 256 p + p' (two), s the value of one unit of v and s_sum = s * sum v,
// both [K / 32, M].
struct Int8Rows {
  int64_t rows;
  std::vector<int8_t> p;
  std::vector<float> s, s_sum;
};

// One group of 32 values (a, b) of input row `row` into group g of `out`: v = round(x / s) to nearest
// even with s = max |x| / 127 (one level, llama.cpp's) or max |x| / 32639 (two), so |v| <= 127 or
// 32639; two levels split v into 256 p + p' with p = floor((v + 128) / 256) in [-127, 127] and p' in
// [-128, 127] (two int8 rows).
template <int kLevels>
SS_AVX512 SS_INLINE void quantize_group(__m512 a, __m512 b, Int8Rows& out, int64_t row, int64_t g) {
  constexpr float kUnits = kLevels == 1 ? 127.0f : 127.0f * 256.0f + 127.0f;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float inverse = amax > 0.0f ? kUnits / amax : 0.0f;
  // Round to nearest even (the default rounding mode); |x| * kUnits / amax <= kUnits, so no saturation.
  const __m512i va = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));
  const __m512i vb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
  int8_t* dst = out.p.data() + (g * out.rows + row) * kLevels * kGroup;
  if constexpr (kLevels == 1) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(va));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(vb));
  } else {
    const __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(va, _mm512_set1_epi32(128)), 8);
    const __m512i hb = _mm512_srai_epi32(_mm512_add_epi32(vb, _mm512_set1_epi32(128)), 8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(ha));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(hb));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + kGroup), _mm512_cvtsepi32_epi8(_mm512_sub_epi32(va, _mm512_slli_epi32(ha, 8))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + kGroup + 16), _mm512_cvtsepi32_epi8(_mm512_sub_epi32(vb, _mm512_slli_epi32(hb, 8))));
  }
  const float s = amax / kUnits;
  out.s[g * out.rows + row] = s;
  out.s_sum[g * out.rows + row] = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(va, vb)));
}

template <int kLevels, typename T>
SS_AVX512 void quantize_rows(const T* x, int64_t rows, int64_t k, Int8Rows& out) {
  const int64_t groups = k / kGroup;
  out.rows = rows;
  out.p.resize(kLevels * rows * k);
  out.s.resize(rows * groups);
  out.s_sum.resize(rows * groups);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      quantize_group<kLevels>(load16(x + r * k + g * kGroup), load16(x + r * k + g * kGroup + 16), out, r, g);
    }
  }
}

SS_VNNI SS_INLINE __m512i dot4(__m512i acc, __m512i weights, const int8_t* p) {  // acc_i += sum_j w[4i + j] * p[j]
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm512_dpbusd_epi32(acc, weights, _mm512_set1_epi32(four));
}

// One panel (16 output rows) times R input rows (from row `first`), all groups. The integer sums are
// exact, so how they are split does not change a row's result; per row and group the float work is
// the same whatever R: v's dot in one int32 (256 * level 1 + level 2), one conversion, two FMAs.
template <int kBits, int kLevels, int R, typename T>
SS_VNNI void panel_rows(const uint8_t* panel, const c10::Half* scales, const Int8Rows& x, int64_t first, int64_t k,
                        T* y, int64_t n) {
  constexpr int64_t kChunks = kBits == 4 ? 4 : 8;
  // Independent VPDPBUSD chains per level: with fewer than 4 in all, their latency, not their
  // throughput, would bound the pass, so each level's is split in two.
  constexpr int kSplit = R * kLevels < 4 ? 2 : 1;
  const int64_t groups = k / kGroup;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = panel + g * kChunks * 64;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 2 * kLanes)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 2 * kLanes + kLanes)));
    __m512i sums[R][kLevels][kSplit];
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kLevels; ++l)
        for (int h = 0; h < kSplit; ++h) sums[r][l][h] = _mm512_setzero_si512();
    for (int64_t c = 0; c < kChunks; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + c * 64), _MM_HINT_T0);
      const __m512i chunk = _mm512_loadu_si512(w + c * 64);
      const __m512i low = kBits == 4 ? _mm512_and_si512(chunk, _mm512_set1_epi8(0x0F)) : chunk;
      const __m512i high = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), _mm512_set1_epi8(0x0F));
      for (int r = 0; r < R; ++r) {
        for (int l = 0; l < kLevels; ++l) {
          const int8_t* p = x.p.data() + ((g * x.rows + first + r) * kLevels + l) * kGroup;
          if constexpr (kBits == 4) {
            sums[r][l][0] = dot4(sums[r][l][0], low, p + c * 8);
            sums[r][l][kSplit - 1] = dot4(sums[r][l][kSplit - 1], high, p + c * 8 + 4);
          } else {
            sums[r][l][c % kSplit] = dot4(sums[r][l][c % kSplit], low, p + c * 4);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512i level[kLevels];
      for (int l = 0; l < kLevels; ++l) level[l] = kSplit == 2 ? _mm512_add_epi32(sums[r][l][0], sums[r][l][kSplit - 1]) : sums[r][l][0];
      // |256 * level 1 + level 2| <= 32 * 255 * 32639 < 2^31; its conversion rounds to float32 (above 2^24) the same everywhere.
      const __m512i dots = kLevels == 2 ? _mm512_add_epi32(_mm512_slli_epi32(level[0], 8), level[kLevels - 1]) : level[0];
      const int64_t i = g * x.rows + first + r;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(d, _mm512_set1_ps(x.s[i])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s_sum[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(y + (first + r) * n, acc[r]);
}

// The last `rows` (< kPassRows) input rows through one panel, in one pass of that many.
template <int kBits, int kLevels, int R, typename T>
SS_VNNI void panel_tail(const uint8_t* panel_bytes, const c10::Half* scales, const Int8Rows& x, int64_t first, int64_t rows,
                        int64_t k, T* y, int64_t n) {
  if constexpr (R > 0) {
    if (rows == R) panel_rows<kBits, kLevels, R>(panel_bytes, scales, x, first, k, y, n);
    else panel_tail<kBits, kLevels, R - 1>(panel_bytes, scales, x, first, rows, k, y, n);
  }
}

// All `rows` input rows through one panel, kPassRows at a time.
template <int kBits, int kLevels, typename T>
SS_VNNI void panel(const uint8_t* panel_bytes, const c10::Half* scales, const Int8Rows& x, int64_t rows, int64_t k, T* y, int64_t n) {
  int64_t r = 0;
  for (; r + kPassRows <= rows; r += kPassRows) panel_rows<kBits, kLevels, kPassRows>(panel_bytes, scales, x, r, k, y, n);
  // the weight panel is in L1 by now: the tail re-reads it from there
  panel_tail<kBits, kLevels, kPassRows - 1>(panel_bytes, scales, x, r, rows - r, k, y, n);
}

template <int kLevels, typename T>
SS_VNNI void panel_any_bits(int64_t bits, const uint8_t* panel_bytes, const c10::Half* scales, const Int8Rows& x, int64_t rows,
                            int64_t k, T* y, int64_t n) {
  if (bits == 4) panel<4, kLevels>(panel_bytes, scales, x, rows, k, y, n);
  else panel<8, kLevels>(panel_bytes, scales, x, rows, k, y, n);
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t bits, int64_t input_bits) {
  TORCH_CHECK(cpu_has_avx512_vnni(), "quant_linear needs AVX512-VNNI (check has_avx512_vnni first)");
  TORCH_CHECK(bits == 4 || bits == 8, "quant_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(input_bits == 8 || input_bits == 16, "quant_linear: input_bits must be 8 or 16, got ", input_bits);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && is_kernel_dtype(x.scalar_type()), "quant_linear: x must be [M, K] contiguous bfloat16 or float32");
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kGroup;
  const int64_t panel_bytes = groups * kGroup * kLanes * bits / 8;
  TORCH_CHECK(k % kGroup == 0, "quant_linear: K must be a multiple of 32, got ", k);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(1) == groups &&
                  packed.size(2) == kGroup * kLanes * bits / 8,
              "quant_linear: packed must be uint8 [N / 16, K / 32, ", kGroup * kLanes * bits / 8, "] for K = ", k, ", got ", packed.sizes());
  const int64_t panels = packed.size(0), n = panels * kLanes;
  TORCH_CHECK(scales.dim() == 4 && scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == panels &&
                  scales.size(1) == groups && scales.size(2) == 2 && scales.size(3) == kLanes,
              "quant_linear: scales must be float16 [N / 16, K / 32, 2, 16], got ", scales.sizes());
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  Int8Rows quantized;
  const int levels = input_bits / 8;
  dispatch_kernel_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if (levels == 1) quantize_rows<1>(x.data_ptr<T>(), rows, k, quantized);
    else quantize_rows<2>(x.data_ptr<T>(), rows, k, quantized);
    const uint8_t* weights = packed.data_ptr<uint8_t>();
    const c10::Half* scale = scales.data_ptr<c10::Half>();
    T* out = y.data_ptr<T>();
    // ~64 KB of weights per thread at least: one panel of a small layer is a few KB.
    const int64_t grain = std::max<int64_t>(1, 65536 / panel_bytes);
    at::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const uint8_t* w = weights + p * panel_bytes;
        const c10::Half* s = scale + p * groups * 2 * kLanes;
        if (levels == 1) panel_any_bits<1>(bits, w, s, quantized, rows, k, out + p * kLanes, n);
        else panel_any_bits<2>(bits, w, s, quantized, rows, k, out + p * kLanes, n);
      }
    });
  });
  return y;
}

}  // namespace stageserve
