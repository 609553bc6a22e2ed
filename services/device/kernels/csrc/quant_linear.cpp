// Weight-only quantized linear for inputs of a few rows: 4-, 5-, 6- or 8-bit weights in groups of 32
// along K times activations quantized per row to int8 in groups of 32 (x ~ s * p, s = max |x| / 127),
// the integer dot products on AVX512-VNNI (VPDPBUSD: 64 u8 x s8 products per instruction). Per group,
// w = d * q + m with d and m float16 (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0), or llama.cpp's K-quant super-blocks
// of 256 (ggml-quants.c, dequantize_row_q4_K / _q5_K / _q6_K): Q4_K/Q5_K w = (d sc) q - (dmin m) with
// float16 d, dmin per super-block and 6-bit sc, m per group of 32; Q6_K w = (d sc) (q - 32) with int8 sc
// per 16 inputs. This is llama.cpp's scheme for Q4_0/Q4_1/Q8_0 x Q8_0/Q8_1 (ggml_vec_dot_q4_1_q8_1):
// per group, sum_k w_k x_k = s (d * sum_k q_k p_k + m * sum_k p_k); its K-quant dots
// (ggml_vec_dot_q4_K_q8_K) take one input scale per 256, here it stays per 32 (the Q4 path's rounding),
// and d sc, dmin m (exact in float32) are formed per group in float.
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
// groups of 32 inputs consecutive (64 * bits bytes each); within a group, 64-byte chunks holding 4
// inputs of each of the 16 rows (byte 4 i + j = row i, input j), i.e. one VPDPBUSD operand per chunk
// with the row in the int32 lane. 4- to 6-bit: chunk c (of 4) holds inputs 8c..8c+3 in its low
// nibbles, 8c+4..8c+7 in its high ones (operands 2c and 2c + 1), then 5 and 6 bits add one and two
// 64-byte bit planes, bit t of plane byte b being bit 4 (5) of operand t's byte b. 8-bit: chunk c (of
// 8) holds inputs 4c..4c+3 as q + 128 (unsigned; m = -128 d restores the sign). Scales: see `Scheme`
// and ops.h. Where m = -2^(bits - 1) d (Q4_0, Q5_0, Q8_0: ggml's symmetric formats), only d is held
// (the file's bytes, not 0.5 bit a weight more) and the offset is taken in integers: sum (q - 2^(bits-1)) v.
// Every lane sums its own row, so there is no horizontal reduction; a thread takes whole panels.

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <vector>

#define SS_VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,avx512vnni,f16c")))

namespace stageserve {

bool cpu_has_avx512_vnni() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return has;
}

namespace {

// How a panel's scales are laid out (the op's `scheme`): per group of 32 (float16 d, m), or per
// K-quant super-block of 256 (ggml's Q4_K/Q5_K: float16 d, dmin and 6-bit sub-block sc, m; Q6_K: float16 d
// and int8 sc per 16 inputs), or per group of 32 float16 d alone, m being -2^(bits - 1) d (Q4_0, Q5_0, Q8_0).
enum class Scheme : int64_t { kGroup = 0, kSuperMin = 1, kSuperSymmetric = 2, kGroupSymmetric = 3 };

constexpr int64_t kGroup = 32;     // inputs per scale
constexpr int64_t kLanes = 16;     // output rows per panel (one per int32 lane)
constexpr int64_t kSuper = 256;    // inputs per K-quant super-block (ggml's QK_K)
constexpr int64_t kGroupsPerSuper = kSuper / kGroup;
// Bytes of one panel's scales per super-block: Q4_K/Q5_K 16 d + 16 dmin (float16), then per group 16 sc
// + 16 m (uint8); Q6_K 16 d (float16), then per half-group of 16 inputs 16 sc (int8).
constexpr int64_t kMinScaleBytes = 4 * kLanes + kGroupsPerSuper * 2 * kLanes;
constexpr int64_t kSymScaleBytes = 2 * kLanes + 2 * kGroupsPerSuper * kLanes;
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
// both [K / 32, M], and the integer sums of v over the group's two halves, v_half [K / 32, M, 2]
// (Q6_K's sub-blocks of 16 take their -32 offset in integers).
struct Int8Rows {
  int64_t rows;
  std::vector<int8_t> p;
  std::vector<float> s, s_sum;
  std::vector<int32_t> v_half;
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
  const int32_t sum_a = _mm512_reduce_add_epi32(va), sum_b = _mm512_reduce_add_epi32(vb);
  out.s[g * out.rows + row] = s;
  out.s_sum[g * out.rows + row] = s * static_cast<float>(sum_a + sum_b);
  out.v_half[(g * out.rows + row) * 2] = sum_a;
  out.v_half[(g * out.rows + row) * 2 + 1] = sum_b;
}

template <int kLevels, typename T>
SS_AVX512 void quantize_rows(const T* x, int64_t rows, int64_t k, Int8Rows& out) {
  const int64_t groups = k / kGroup;
  out.rows = rows;
  out.p.resize(kLevels * rows * k);
  out.s.resize(rows * groups);
  out.s_sum.resize(rows * groups);
  out.v_half.resize(2 * rows * groups);
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

SS_VNNI SS_INLINE __m512 half16(const uint8_t* p) {  // 16 float16 -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Operand `t`'s bit 4 (or 5) from a bit plane: byte b of the plane holds bit t for operand t's byte b.
SS_VNNI SS_INLINE __m512i add_plane_bit(__m512i operand, __m512i plane, int t, int value) {
  const __mmask64 set = _mm512_test_epi8_mask(plane, _mm512_set1_epi8(static_cast<char>(1 << t)));
  return _mm512_mask_add_epi8(operand, set, operand, _mm512_set1_epi8(static_cast<char>(value)));
}

// Chunk c of a 4- to 6-bit group `w` (its bit planes loaded into `plane`) as its two VPDPBUSD operands:
// inputs 8c..8c+3 (`low`) and 8c+4..8c+7 (`high`), unsigned 0..2^bits - 1.
template <int kBits>
SS_VNNI SS_INLINE void unpack_chunk(const uint8_t* w, const __m512i* plane, int c, __m512i& low, __m512i& high) {
  const __m512i chunk = _mm512_loadu_si512(w + c * 64);
  low = _mm512_and_si512(chunk, _mm512_set1_epi8(0x0F));
  high = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), _mm512_set1_epi8(0x0F));
  if constexpr (kBits == 5 || kBits == 6) {
    for (int b = 0; b < kBits - 4; ++b) {
      low = add_plane_bit(low, plane[b], 2 * c, 16 << b);
      high = add_plane_bit(high, plane[b], 2 * c + 1, 16 << b);
    }
  }
}

// Where a pass takes a 5- or 6-bit panel's operands from: the packed panel; the packed panel, storing
// the operands it makes into a buffer [K / 32, 8, 64] (operand 2c + h of group g at (8 g + 2c + h) * 64);
// or such a buffer. A panel that several passes of input rows take is unpacked once, by the first pass,
// and the later passes load the operands rather than making them again (for Q6_K, 11 vector operations
// a chunk beside the 16 VPDPBUSD of an 8-row pass). Unpacking before the first pass instead, with no
// arithmetic to hide the weight stream behind, took longer than it saved; for a 4-bit panel (three
// operations a chunk) the buffer's stores and loads cost more than they save (docs/benchmarks.md).
enum class Source { kPacked, kPackedStoring, kUnpacked };
constexpr int64_t kUnpackedGroupBytes = 8 * 64;

// One panel (16 output rows) times R input rows (from row `first`), all groups. The integer sums are
// exact, so how they are split does not change a row's result; per row and group the float work is
// the same whatever R: v's dot in one int32 (256 * level 1 + level 2), one conversion, two FMAs (Q6_K:
// per half-group, one conversion and one FMA, its -32 offset subtracted in integers).
// kSource: where the operands come from (`Source`); `unpacked` is the buffer stored into with
// kPackedStoring.
template <int kBits, Scheme kScheme, int kLevels, int R, Source kSource, typename T>
SS_VNNI void panel_rows(const uint8_t* panel, const uint8_t* scales, const Int8Rows& x, int64_t first, int64_t k,
                        T* y, int64_t n, uint8_t* unpacked = nullptr) {
  constexpr bool kUnpacked = kSource == Source::kUnpacked;
  constexpr int64_t kChunks = kBits == 8 ? 8 : 4;  // 64-byte VPDPBUSD operands (4-6 bits: nibble pairs) per group
  constexpr int kSubs = kScheme == Scheme::kSuperSymmetric ? 2 : 1;  // weight scales per group
  // Independent VPDPBUSD chains per level: with fewer than 4 in all, their latency, not their
  // throughput, would bound the pass, so each level's is split in two.
  constexpr int kSplit = R * kLevels < 4 ? 2 : 1;
  const int64_t groups = k / kGroup;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = panel + g * (kUnpacked ? kUnpackedGroupBytes : 64 * kBits);
    // per lane: w = d * q + m (group scales, Q4_K/Q5_K), or d_half * (q - 32) (Q6_K)
    __m512 d[kSubs], m = _mm512_setzero_ps();
    if constexpr (kScheme == Scheme::kGroup) {
      d[0] = half16(scales + g * 4 * kLanes);
      m = half16(scales + g * 4 * kLanes + 2 * kLanes);
    } else if constexpr (kScheme == Scheme::kGroupSymmetric) {
      d[0] = half16(scales + g * 2 * kLanes);
    } else if constexpr (kScheme == Scheme::kSuperMin) {  // d * sc and dmin * m, each exact in float32 (11 x 6 bits)
      const uint8_t* super = scales + (g / kGroupsPerSuper) * kMinScaleBytes;
      const uint8_t* sub = super + 4 * kLanes + (g % kGroupsPerSuper) * 2 * kLanes;
      const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub))));
      const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + kLanes))));
      d[0] = _mm512_mul_ps(half16(super), sc);
      m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(half16(super + 2 * kLanes), mn));
    } else {  // d * sc exact in float32 (11 x 8 bits)
      const uint8_t* super = scales + (g / kGroupsPerSuper) * kSymScaleBytes;
      const __m512 dsuper = half16(super);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* sub = super + 2 * kLanes + (2 * (g % kGroupsPerSuper) + h) * kLanes;
        d[h] = _mm512_mul_ps(dsuper, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub)))));
      }
    }
    __m512i plane[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    if constexpr ((kBits == 5 || kBits == 6) && !kUnpacked) {
      for (int b = 0; b < kBits - 4; ++b) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + (4 + b) * 64), _MM_HINT_T0);
        plane[b] = _mm512_loadu_si512(w + (4 + b) * 64);
      }
    }
#pragma GCC unroll 2
    for (int sub = 0; sub < kSubs; ++sub) {
      __m512i sums[R][kLevels][kSplit];
      for (int r = 0; r < R; ++r)
        for (int l = 0; l < kLevels; ++l)
          for (int h = 0; h < kSplit; ++h) sums[r][l][h] = _mm512_setzero_si512();
      // Unrolled (with the loop over subs above), the rows' inputs at fixed offsets from one pointer:
      // each sum stays in its register and each bit-plane mask is a constant (rolled, every sum was
      // copied through another register per chunk, and Q6_K built its masks at run time).
      const int8_t* inputs = x.p.data() + (g * x.rows + first) * kLevels * kGroup;
#pragma GCC unroll 8
      for (int64_t c = sub * kChunks / kSubs; c < (sub + 1) * kChunks / kSubs; ++c) {
        __m512i low, high;
        if constexpr (kUnpacked) {
          low = _mm512_loadu_si512(w + 2 * c * 64);
          high = _mm512_loadu_si512(w + (2 * c + 1) * 64);
        } else {
          _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + c * 64), _MM_HINT_T0);
          if constexpr (kBits == 8) {
            low = _mm512_loadu_si512(w + c * 64);
          } else {
            unpack_chunk<kBits>(w, plane, static_cast<int>(c), low, high);
            if constexpr (kSource == Source::kPackedStoring) {
              _mm512_storeu_si512(unpacked + g * kUnpackedGroupBytes + 2 * c * 64, low);
              _mm512_storeu_si512(unpacked + g * kUnpackedGroupBytes + (2 * c + 1) * 64, high);
            }
          }
        }
        for (int r = 0; r < R; ++r) {
          for (int l = 0; l < kLevels; ++l) {
            const int8_t* p = inputs + (r * kLevels + l) * kGroup;
            if constexpr (kBits == 8) {
              sums[r][l][c % kSplit] = dot4(sums[r][l][c % kSplit], low, p + c * 4);
            } else {
              sums[r][l][0] = dot4(sums[r][l][0], low, p + c * 8);
              sums[r][l][kSplit - 1] = dot4(sums[r][l][kSplit - 1], high, p + c * 8 + 4);
            }
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        __m512i level[kLevels];
        for (int l = 0; l < kLevels; ++l) level[l] = kSplit == 2 ? _mm512_add_epi32(sums[r][l][0], sums[r][l][kSplit - 1]) : sums[r][l][0];
        // |256 * level 1 + level 2| <= 32 * 255 * 32639 < 2^31; its conversion rounds to float32 (above 2^24) the same everywhere.
        __m512i dots = kLevels == 2 ? _mm512_add_epi32(_mm512_slli_epi32(level[0], 8), level[kLevels - 1]) : level[0];
        const int64_t i = g * x.rows + first + r;
        if constexpr (kScheme == Scheme::kSuperSymmetric) {  // sum (q - 32) v over the half: |.| <= 16 * 32 * 32639 < 2^24, exact
          dots = _mm512_sub_epi32(dots, _mm512_set1_epi32(32 * x.v_half[2 * i + sub]));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(d[sub], _mm512_set1_ps(x.s[i])), acc[r]);
        } else if constexpr (kScheme == Scheme::kGroupSymmetric) {  // sum (q - 2^(bits-1)) v: |.| <= 32 * 128 * 32639 < 2^31
          constexpr int32_t kOffset = 1 << (kBits - 1);
          dots = _mm512_sub_epi32(dots, _mm512_set1_epi32(kOffset * (x.v_half[2 * i] + x.v_half[2 * i + 1])));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(d[0], _mm512_set1_ps(x.s[i])), acc[r]);
        } else {
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(d[0], _mm512_set1_ps(x.s[i])), acc[r]);
          acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s_sum[i]), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) store16(y + (first + r) * n, acc[r]);
}

// The last `rows` (< kPassRows) input rows through one panel, in one pass of that many.
template <int kBits, Scheme kScheme, int kLevels, Source kSource, int R, typename T>
SS_VNNI void panel_tail(const uint8_t* panel_bytes, const uint8_t* scales, const Int8Rows& x, int64_t first, int64_t rows,
                        int64_t k, T* y, int64_t n) {
  if constexpr (R > 0) {
    if (rows == R) panel_rows<kBits, kScheme, kLevels, R, kSource>(panel_bytes, scales, x, first, k, y, n);
    else panel_tail<kBits, kScheme, kLevels, kSource, R - 1>(panel_bytes, scales, x, first, rows, k, y, n);
  }
}

// Input rows [first, end) through one panel, kPassRows at a time.
template <int kBits, Scheme kScheme, int kLevels, Source kSource, typename T>
SS_VNNI void panel_passes(const uint8_t* panel_bytes, const uint8_t* scales, const Int8Rows& x, int64_t first, int64_t end, int64_t k,
                          T* y, int64_t n) {
  int64_t r = first;
  for (; r + kPassRows <= end; r += kPassRows) panel_rows<kBits, kScheme, kLevels, kPassRows, kSource>(panel_bytes, scales, x, r, k, y, n);
  // the weight panel (or its operands) is in L1 by now: the tail re-reads it from there
  panel_tail<kBits, kScheme, kLevels, kSource, kPassRows - 1>(panel_bytes, scales, x, r, end - r, k, y, n);
}

// Input rows [first, end) through one panel; a 5- or 6-bit panel that more than one pass takes is unpacked
// by the first into this thread's buffer (`Source`). The operands are the same bytes either way, so the
// outputs are the same bits.
template <int kBits, Scheme kScheme, int kLevels, typename T>
SS_VNNI void panel(const uint8_t* panel_bytes, const uint8_t* scales, const Int8Rows& x, int64_t first, int64_t end, int64_t k, T* y,
                   int64_t n) {
  if constexpr (kBits == 5 || kBits == 6) {
    if (end - first > kPassRows) {
      thread_local std::vector<uint8_t> unpacked;
      unpacked.resize(k / kGroup * kUnpackedGroupBytes);
      panel_rows<kBits, kScheme, kLevels, kPassRows, Source::kPackedStoring>(panel_bytes, scales, x, first, k, y, n, unpacked.data());
      panel_passes<kBits, kScheme, kLevels, Source::kUnpacked>(unpacked.data(), scales, x, first + kPassRows, end, k, y, n);
      return;
    }
  }
  panel_passes<kBits, kScheme, kLevels, Source::kPacked>(panel_bytes, scales, x, first, end, k, y, n);
}

// The formats the op takes, as (bits, scheme) pairs.
template <int kLevels, typename T>
SS_VNNI void panel_any_format(int64_t bits, Scheme scheme, const uint8_t* panel_bytes, const uint8_t* scales, const Int8Rows& x,
                              int64_t first, int64_t end, int64_t k, T* y, int64_t n) {
  if (scheme == Scheme::kGroup) {
    if (bits == 4) panel<4, Scheme::kGroup, kLevels>(panel_bytes, scales, x, first, end, k, y, n);
    else if (bits == 5) panel<5, Scheme::kGroup, kLevels>(panel_bytes, scales, x, first, end, k, y, n);
    else panel<8, Scheme::kGroup, kLevels>(panel_bytes, scales, x, first, end, k, y, n);
  } else if (scheme == Scheme::kGroupSymmetric) {
    if (bits == 4) panel<4, Scheme::kGroupSymmetric, kLevels>(panel_bytes, scales, x, first, end, k, y, n);
    else if (bits == 5) panel<5, Scheme::kGroupSymmetric, kLevels>(panel_bytes, scales, x, first, end, k, y, n);
    else panel<8, Scheme::kGroupSymmetric, kLevels>(panel_bytes, scales, x, first, end, k, y, n);
  } else if (scheme == Scheme::kSuperMin) {
    if (bits == 4) panel<4, Scheme::kSuperMin, kLevels>(panel_bytes, scales, x, first, end, k, y, n);
    else panel<5, Scheme::kSuperMin, kLevels>(panel_bytes, scales, x, first, end, k, y, n);
  } else {
    panel<6, Scheme::kSuperSymmetric, kLevels>(panel_bytes, scales, x, first, end, k, y, n);
  }
}

// A weight as quant_linear takes it, checked against the inputs' K.
struct Format {
  int64_t bits;
  Scheme scheme;
  int levels;  // int8 input levels
  int64_t k, n, panels, panel_bytes, scale_bytes;
};

Format check_format(int64_t k, const at::Tensor& packed, const at::Tensor& scales, int64_t bits, int64_t input_bits, int64_t scheme_code) {
  TORCH_CHECK(cpu_has_avx512_vnni(), "quant_linear needs AVX512-VNNI (check has_avx512_vnni first)");
  TORCH_CHECK(scheme_code >= 0 && scheme_code <= 3, "quant_linear: scheme must be 0 (group), 1 (Q4_K/Q5_K), 2 (Q6_K) or 3 (symmetric group), got ",
              scheme_code);
  const Scheme scheme = static_cast<Scheme>(scheme_code);
  const bool per_group = scheme == Scheme::kGroup || scheme == Scheme::kGroupSymmetric;
  const bool bits_ok = per_group ? (bits == 4 || bits == 5 || bits == 8) : scheme == Scheme::kSuperMin ? (bits == 4 || bits == 5) : bits == 6;
  TORCH_CHECK(bits_ok, "quant_linear: bits ", bits, " do not go with scheme ", scheme_code, " (group, symmetric group: 4, 5, 8; Q4_K/Q5_K: 4, 5; Q6_K: 6)");
  TORCH_CHECK(input_bits == 8 || input_bits == 16, "quant_linear: input_bits must be 8 or 16, got ", input_bits);
  const int64_t groups = k / kGroup;
  const int64_t group_bytes = kGroup * kLanes * bits / 8, panel_bytes = groups * group_bytes;
  TORCH_CHECK(k % (per_group ? kGroup : kSuper) == 0, "quant_linear: K must be a multiple of ", per_group ? kGroup : kSuper,
              " for scheme ", scheme_code, ", got ", k);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(1) == groups &&
                  packed.size(2) == group_bytes,
              "quant_linear: packed must be uint8 [N / 16, K / 32, ", group_bytes, "] for K = ", k, ", got ", packed.sizes());
  const int64_t panels = packed.size(0);
  const int64_t scale_bytes = scheme == Scheme::kGroup ? groups * 4 * kLanes
                              : scheme == Scheme::kGroupSymmetric ? groups * 2 * kLanes
                              : (k / kSuper) * (scheme == Scheme::kSuperMin ? kMinScaleBytes : kSymScaleBytes);
  TORCH_CHECK(scales.is_contiguous() && scales.size(0) == panels && scales.nbytes() == panels * scale_bytes &&
                  (per_group ? scales.scalar_type() == at::kHalf : scales.scalar_type() == at::kByte),
              "quant_linear: scales must be float16 [N / 16, K / 32, 2, 16] (group), float16 [N / 16, K / 32, 16] (symmetric group) "
              "or uint8 [N / 16, K / 256, ", scheme == Scheme::kSuperSymmetric ? kSymScaleBytes : kMinScaleBytes, "] (K-quants), got ",
              scales.sizes(), " ", scales.scalar_type());
  return {bits, scheme, static_cast<int>(input_bits / 8), k, panels * kLanes, panels, panel_bytes, scale_bytes};
}

void check_input(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && is_kernel_dtype(x.scalar_type()), "quant_linear: x must be [M, K] contiguous bfloat16 or float32");
}

Int8Rows quantize(const at::Tensor& x, int levels) {
  Int8Rows quantized;
  dispatch_kernel_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if (levels == 1) quantize_rows<1>(x.const_data_ptr<T>(), x.size(0), x.size(1), quantized);
    else quantize_rows<2>(x.const_data_ptr<T>(), x.size(0), x.size(1), quantized);
  });
  return quantized;
}

// One weight over the quantized input rows [first, end), into the same rows of y [M, N].
struct PanelWork {
  const Format* format;
  const uint8_t* weights;
  const uint8_t* scales;
  const Int8Rows* x;
  int64_t first, end;
  at::Tensor* y;

  // Panels [begin, stop) of the weight.
  void run(int64_t begin, int64_t stop) const {
    const Format& f = *format;
    dispatch_kernel_dtype(y->scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      T* out = static_cast<T*>(y->data_ptr());
      for (int64_t p = begin; p < stop; ++p) {
        const uint8_t* w = weights + p * f.panel_bytes;
        const uint8_t* s = scales + p * f.scale_bytes;
        if (f.levels == 1) panel_any_format<1>(f.bits, f.scheme, w, s, *x, first, end, f.k, out + p * kLanes, f.n);
        else panel_any_format<2>(f.bits, f.scheme, w, s, *x, first, end, f.k, out + p * kLanes, f.n);
      }
    });
  }
};

// Every work's panels in one parallel region, in chunks of ~64 KB of weights (one panel of a small layer
// is a few KB) that the threads take in turn: a mixture's experts share one fork and join.
void run_works(const std::vector<PanelWork>& works) {
  struct Chunk {
    const PanelWork* work;
    int64_t begin, end;
  };
  std::vector<Chunk> chunks;
  for (const PanelWork& work : works) {
    const int64_t panels = work.format->panels, grain = std::max<int64_t>(1, 65536 / work.format->panel_bytes);
    for (int64_t p = 0; p < panels; p += grain) chunks.push_back({&work, p, std::min(panels, p + grain)});
  }
  parallel_chunks(static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) chunks[c].work->run(chunks[c].begin, chunks[c].end);
  });
}

}  // namespace

at::Tensor quant_linear_segments(const at::Tensor& x, at::TensorList packed, at::TensorList scales, at::IntArrayRef counts, int64_t bits,
                                 int64_t input_bits, int64_t scheme) {
  check_input(x);
  TORCH_CHECK(!packed.empty() && packed.size() == scales.size() && packed.size() == counts.size(),
              "quant_linear_segments: one packed weight, one scales tensor and one row count per segment, got ", packed.size(), ", ",
              scales.size(), " and ", counts.size());
  std::vector<Format> formats;
  formats.reserve(packed.size());
  int64_t rows = 0;
  for (size_t i = 0; i < packed.size(); ++i) {
    formats.push_back(check_format(x.size(1), packed[i], scales[i], bits, input_bits, scheme));
    TORCH_CHECK(formats[i].n == formats[0].n, "quant_linear_segments: segment ", i, " has ", formats[i].n, " outputs, segment 0 ", formats[0].n);
    TORCH_CHECK(counts[i] >= 0, "quant_linear_segments: segment ", i, " has a negative row count");
    rows += counts[i];
  }
  TORCH_CHECK(rows == x.size(0), "quant_linear_segments: the segments' row counts add up to ", rows, ", x has ", x.size(0), " rows");
  at::Tensor y = at::empty({rows, formats[0].n}, x.options());
  if (rows == 0) return y;
  const Int8Rows quantized = quantize(x, formats[0].levels);  // a row's quantization does not depend on the others
  std::vector<PanelWork> works;
  int64_t first = 0;
  for (size_t i = 0; i < packed.size(); ++i) {
    if (counts[i] > 0)
      works.push_back({&formats[i], packed[i].const_data_ptr<uint8_t>(), static_cast<const uint8_t*>(scales[i].const_data_ptr()), &quantized,
                       first, first + counts[i], &y});
    first += counts[i];
  }
  run_works(works);
  return y;
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t bits, int64_t input_bits,
                        int64_t scheme) {
  check_input(x);
  return quant_linear_segments(x, {packed}, {scales}, {x.size(0)}, bits, input_bits, scheme);  // one segment: every row
}

at::Tensor quant_rows(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& ids, c10::ScalarType dtype) {
  TORCH_CHECK(is_kernel_dtype(dtype), "quant_rows: dtype must be bfloat16 or float32, got ", dtype);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(2) == 8 * 64,
              "quant_rows: packed must be an int8 weight's uint8 [N / 16, K / 32, 512], got ", packed.sizes());
  const int64_t panels = packed.size(0), groups = packed.size(1), k = groups * kGroup;
  // d and m (scheme 0) or d alone (scheme 3): only d is read, the values being signed.
  const int64_t scales_per_group = scales.dim() == 4 ? 2 : 1;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == panels && scales.size(1) == groups &&
                  ((scales.dim() == 4 && scales.size(2) == 2 && scales.size(3) == kLanes) || (scales.dim() == 3 && scales.size(2) == kLanes)),
              "quant_rows: scales must be float16 [N / 16, K / 32, 2, 16] or [N / 16, K / 32, 16], got ", scales.sizes(), " ", scales.scalar_type());
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "quant_rows: ids must be int64 [T]");
  const at::Tensor index = ids.contiguous();
  const int64_t* id = index.const_data_ptr<int64_t>();
  const int64_t rows = index.numel();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < panels * kLanes, "quant_rows: row ", id[t], " is outside the weight's ", panels * kLanes, " rows");
  at::Tensor out = at::empty({rows, k}, packed.options().dtype(dtype));
  const uint8_t* w = packed.const_data_ptr<uint8_t>();
  const c10::Half* d = scales.const_data_ptr<c10::Half>();
  dispatch_kernel_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* o = out.data_ptr<T>();
    at::parallel_for(0, rows, rows_per_thread(k), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t panel = id[t] / kLanes, lane = id[t] % kLanes;
        for (int64_t g = 0; g < groups; ++g) {
          const uint8_t* group = w + (panel * groups + g) * 8 * 64 + 4 * lane;  // chunk c's 4 inputs of this row at c * 64
          const float scale = static_cast<float>(d[((panel * groups + g) * scales_per_group) * kLanes + lane]);
          for (int64_t c = 0; c < 8; ++c)
            for (int64_t j = 0; j < 4; ++j)
              o[t * k + g * kGroup + 4 * c + j] = static_cast<T>(static_cast<float>(static_cast<int8_t>(group[c * 64 + j] ^ 0x80)) * scale);
        }
      }
    });
  });
  return out;
}

}  // namespace stageserve
