// Weight-only quantized linear for inputs of a few rows: 4- or 8-bit weights in groups of 32 along K
// (w = d * q + m per group, d and m float16) times activations quantized per row to int8 in groups of
// 32 (x ~ s * p, s = max |x| / 127), the integer dot products on AVX512-VNNI (VPDPBUSD: 64 u8 x s8
// products per instruction). This is llama.cpp's scheme for Q4_0/Q4_1/Q8_0 x Q8_0/Q8_1 (ggml-quants.c,
// ggml_vec_dot_q4_1_q8_1): per group, sum_k w_k x_k = s (d * sum_k q_k p_k + m * sum_k p_k).
// input_bits = 16 adds a second int8 level for what the first leaves, x ~ s p + s' p' with
// s' = max |x - s p| / 127 (error 1/127 of the first's): two rows through the same dots, summed.
//
// Layout (quant.py `VnniWeight` packs it): the weight in panels of 16 output rows, each panel's groups
// of 32 inputs consecutive; within a group, 64-byte chunks holding 4 inputs of each of the 16 rows
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
constexpr int kRowsPerPass = 4;    // activation rows sharing one pass over a panel
// How far ahead of the weight stream to prefetch into L1: the hardware prefetcher alone streamed ~9 GB/s;
// a cold one-row pass over the model's 120 layer linears (benchmarks/quant_linears.py, one input level,
// 2-core Intel Xeon with AMX) went from 5.9 to 3.3 ms with it.
constexpr int64_t kPrefetchBytes = 8192;

// The activation rows as int8 groups, `levels` int8 rows per input row: p [levels * M, K],
// s [levels * M, K / 32] = max |x| / 127 of what the level quantizes, s_sum = s * sum p per group.
struct Int8Rows {
  std::vector<int8_t> p;
  std::vector<float> s, s_sum;
};

// One group of 32 values (a, b) as int8 row `row`, group g of `out`; leaves in (a, b) what the rounding left.
SS_AVX512 SS_INLINE void quantize_group(__m512& a, __m512& b, Int8Rows& out, int64_t row, int64_t g, int64_t k) {
  const int64_t groups = k / kGroup;
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
  // Round to nearest even (the default rounding mode); |x| * 127 / amax <= 127, so no saturation.
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
  int8_t* dst = out.p.data() + row * k + g * kGroup;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(qb));
  const float s = amax / 127.0f;
  out.s[row * groups + g] = s;
  out.s_sum[row * groups + g] = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)));
  a = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qa), _mm512_set1_ps(s), a);
  b = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(qb), _mm512_set1_ps(s), b);
}

// The input rows as `levels` int8 rows each (row r's levels at rows levels * r + l).
template <typename T>
SS_AVX512 void quantize_rows(const T* x, int64_t rows, int64_t k, int levels, Int8Rows& out) {
  const int64_t groups = k / kGroup;
  out.p.resize(levels * rows * k);
  out.s.resize(levels * rows * groups);
  out.s_sum.resize(levels * rows * groups);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      __m512 a = load16(x + r * k + g * kGroup), b = load16(x + r * k + g * kGroup + 16);
      for (int l = 0; l < levels; ++l) quantize_group(a, b, out, levels * r + l, g, k);
    }
  }
}

SS_VNNI SS_INLINE __m512i dot4(__m512i acc, __m512i weights, const int8_t* p) {  // acc_i += sum_j w[4i + j] * p[j]
  int32_t four;
  std::memcpy(&four, p, 4);
  return _mm512_dpbusd_epi32(acc, weights, _mm512_set1_epi32(four));
}

// One panel (16 output rows) times R int8 rows (from row `first`), all groups; each output row is the
// sum of kLevels consecutive int8 rows.
template <int kBits, int kLevels, int R, typename T>
SS_VNNI void panel_rows(const uint8_t* panel, const c10::Half* scales, const Int8Rows& x, int64_t first, int64_t k,
                        T* y, int64_t n) {
  constexpr int64_t kChunks = kBits == 4 ? 4 : 8;
  const int64_t groups = k / kGroup;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = panel + g * kChunks * 64;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 2 * kLanes)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 2 * kLanes + kLanes)));
    __m512i even[R], odd[R];  // two sums per row: VPDPBUSD's latency, not its throughput, would bound one chain
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_si512();
    for (int64_t c = 0; c < kChunks; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + c * 64), _MM_HINT_T0);
      const __m512i chunk = _mm512_loadu_si512(w + c * 64);
      if constexpr (kBits == 4) {
        const __m512i low = _mm512_and_si512(chunk, _mm512_set1_epi8(0x0F));
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), _mm512_set1_epi8(0x0F));
        for (int r = 0; r < R; ++r) {
          const int8_t* p = x.p.data() + (first + r) * k + g * kGroup + c * 8;
          even[r] = dot4(even[r], low, p);
          odd[r] = dot4(odd[r], high, p + 4);
        }
      } else {
        for (int r = 0; r < R; ++r) {
          const int8_t* p = x.p.data() + (first + r) * k + g * kGroup + c * 4;
          if (c % 2 == 0) even[r] = dot4(even[r], chunk, p);
          else odd[r] = dot4(odd[r], chunk, p);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (first + r) * groups + g;
      const __m512 dots = _mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r]));
      acc[r] = _mm512_fmadd_ps(dots, _mm512_mul_ps(d, _mm512_set1_ps(x.s[i])), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s_sum[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; r += kLevels) {
    __m512 sum = acc[r];
    for (int l = 1; l < kLevels; ++l) sum = _mm512_add_ps(sum, acc[r + l]);
    store16(y + (first + r) / kLevels * n, sum);
  }
}

// All int8 rows (`rows` input rows of kLevels each) through one panel, kRowsPerPass at a time.
template <int kBits, int kLevels, typename T>
SS_VNNI void panel(const uint8_t* panel_bytes, const c10::Half* scales, const Int8Rows& x, int64_t rows, int64_t k, T* y, int64_t n) {
  const int64_t total = rows * kLevels;
  int64_t r = 0;
  for (; r + kRowsPerPass <= total; r += kRowsPerPass) panel_rows<kBits, kLevels, kRowsPerPass>(panel_bytes, scales, x, r, k, y, n);
  switch (total - r) {  // the weight panel is in L1 by now: the tail re-reads it from there
    case 3: if constexpr (kLevels == 1) panel_rows<kBits, 1, 3>(panel_bytes, scales, x, r, k, y, n); break;
    case 2: panel_rows<kBits, kLevels, 2>(panel_bytes, scales, x, r, k, y, n); break;
    case 1: if constexpr (kLevels == 1) panel_rows<kBits, 1, 1>(panel_bytes, scales, x, r, k, y, n); break;
    default: break;
  }
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
    quantize_rows(x.data_ptr<T>(), rows, k, levels, quantized);
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
