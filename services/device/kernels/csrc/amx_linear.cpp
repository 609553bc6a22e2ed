// Decode-sized bfloat16 linears on AMX (Intel Advanced Matrix Extensions): y[M, N] = x[M, K] W^T + b
// for M <= 64 rows, W pre-packed once into the tiles' VNNI layout (amx_pack in cpu_kernels.py).
//
// A decode step's linears are a stream over the weights with a few rows of activations: each 16
// output columns' weights are read once (one 1 KB tile per 32 inputs), multiplied into up to four
// 16-row accumulator tiles, and the stream is prefetched ahead. A call costs 2.7 us from Python
// (1 x 64 x 64) where torch's packed oneDNN linear takes 16-22 us, which a decode step pays ~120 times.
// The tile layout and instructions: Intel's AMX programming reference (TDPBF16PS, TILELOADD), as
// oneDNN's brgemm uses them.

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <sys/syscall.h>
#include <unistd.h>


namespace stageserve {

#if defined(SS_HAVE_AMX)
#define SS_AMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma,avx512bf16,amx-tile,amx-bf16")))

bool cpu_has_amx() {
  // The kernel hands out the tile state only on request (Linux 5.16+); oneDNN asks the same way.
  static const bool has = [] {
    if (!cpu_has_avx512_bf16() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
}

namespace {

constexpr int64_t kMaxRows = 64;      // four 16-row accumulator tiles
constexpr int64_t kTileBytes = 1024;  // 16 rows of 64 bytes
// Weight tiles requested ahead of use, into L2: on a 2-core Xeon 16 (16 KB) streamed a model's
// weights ~20 % faster than torch's oneDNN linear, 4 into L1 ~10 %.
constexpr int64_t kPrefetchTiles = 16;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: fp32 accumulators of the row blocks; 4: a full 16-row block of x; 5: x's last block
// (M - 16 * (blocks - 1) rows); 6: the weight tile (16 input pairs x 16 columns).
TileConfig config_for(int64_t rows) {
  TileConfig c;
  const int64_t blocks = (rows + 15) / 16, last = rows - 16 * (blocks - 1);
  for (int64_t b = 0; b < blocks; ++b) {
    c.rows[b] = static_cast<uint8_t>(b + 1 < blocks ? 16 : last);
    c.colsb[b] = 64;
  }
  c.rows[4] = 16, c.colsb[4] = 64;
  c.rows[5] = static_cast<uint8_t>(last), c.colsb[5] = 64;
  c.rows[6] = 16, c.colsb[6] = 64;
  return c;
}

// 16 output columns: acc[row, 16] = x[rows, K] w_block^T, w_block = [K / 32][16][32] packed.
template <int Blocks>
SS_AMX void column_block(const c10::BFloat16* x, int64_t k_steps, int64_t x_stride_bytes, const c10::BFloat16* w_block,
                         float* acc) {
  _tile_zero(0);
  if constexpr (Blocks > 1) _tile_zero(1);
  if constexpr (Blocks > 2) _tile_zero(2);
  if constexpr (Blocks > 3) _tile_zero(3);
  const char* w = reinterpret_cast<const char*>(w_block);
  const char* xs = reinterpret_cast<const char*>(x);
  const int64_t block_stride = 16 * x_stride_bytes;
  for (int64_t s = 0; s < k_steps; ++s, w += kTileBytes, xs += 64) {
    for (int64_t line = 0; line < kTileBytes; line += 64) _mm_prefetch(w + kPrefetchTiles * kTileBytes + line, _MM_HINT_T1);
    _tile_loadd(6, w, 64);
    if constexpr (Blocks == 1) {
      _tile_loadd(5, xs, x_stride_bytes);
      _tile_dpbf16ps(0, 5, 6);
    } else {
      _tile_loadd(4, xs, x_stride_bytes);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (Blocks == 2) {
        _tile_loadd(5, xs + block_stride, x_stride_bytes);
        _tile_dpbf16ps(1, 5, 6);
      } else {
        _tile_loadd(4, xs + block_stride, x_stride_bytes);
        _tile_dpbf16ps(1, 4, 6);
        if constexpr (Blocks == 3) {
          _tile_loadd(5, xs + 2 * block_stride, x_stride_bytes);
          _tile_dpbf16ps(2, 5, 6);
        } else {
          _tile_loadd(4, xs + 2 * block_stride, x_stride_bytes);
          _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(5, xs + 3 * block_stride, x_stride_bytes);
          _tile_dpbf16ps(3, 5, 6);
        }
      }
    }
  }
  _tile_stored(0, acc, 64);
  if constexpr (Blocks > 1) _tile_stored(1, acc + 256, 64);
  if constexpr (Blocks > 2) _tile_stored(2, acc + 512, 64);
  if constexpr (Blocks > 3) _tile_stored(3, acc + 768, 64);
}

// Output column blocks [n_begin, n_end) of 16. Gated (SwiGLU): the packed weight alternates gate and
// up blocks (amx_pack_gated), and block nb of the output is silu(gate block nb) * up block nb,
// from both fp32 sums, rounded once (no [rows, 2 * N] intermediate).
template <int Blocks, bool Gated>
SS_AMX void columns(const c10::BFloat16* x, int64_t rows, int64_t K, int64_t x_stride, const c10::BFloat16* w, const c10::BFloat16* bias,
                    int64_t n_begin, int64_t n_end, c10::BFloat16* out, int64_t out_stride) {
  const TileConfig cfg = config_for(rows);
  _tile_loadconfig(&cfg);
  alignas(64) float acc[kMaxRows * 16];
  alignas(64) float up[Gated ? kMaxRows * 16 : 1];
  const int64_t k_steps = K / 32, block_elems = k_steps * 512;
  for (int64_t nb = n_begin; nb < n_end; ++nb) {
    if constexpr (Gated) {
      column_block<Blocks>(x, k_steps, x_stride * 2, w + 2 * nb * block_elems, acc);
      column_block<Blocks>(x, k_steps, x_stride * 2, w + (2 * nb + 1) * block_elems, up);
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 y = _mm512_mul_ps(silu16<false>(_mm512_load_ps(acc + r * 16)), _mm512_load_ps(up + r * 16));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + nb * 16), (__m256i)_mm512_cvtneps_pbh(y));
      }
    } else {
      column_block<Blocks>(x, k_steps, x_stride * 2, w + nb * block_elems, acc);
      const __m512 b = bias != nullptr ? load16(bias + nb * 16) : _mm512_setzero_ps();
      for (int64_t r = 0; r < rows; ++r)  // fp32 sums + bias, rounded once
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * out_stride + nb * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(acc + r * 16), b)));
    }
  }
  _tile_release();
}

using ColumnsFn = void (*)(const c10::BFloat16*, int64_t, int64_t, int64_t, const c10::BFloat16*, const c10::BFloat16*, int64_t,
                           int64_t, c10::BFloat16*, int64_t);

// Checks, then runs `columns` over `blocks` output column blocks on torch's threads.
template <bool Gated>
at::Tensor run(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, const char* name) {
  TORCH_CHECK(cpu_has_amx(), name, " needs a CPU with AMX-BF16 (and a kernel that grants it)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16, "x must be bfloat16 [rows, K] with contiguous rows, got ",
              x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 && packed.size(2) == 16 &&
                  packed.size(3) == 32 && (!Gated || packed.size(0) % 2 == 0),
              "packed must be ", Gated ? "amx_pack_gated" : "amx_pack", "'s [N / 16, K / 32, 16, 32] bfloat16, got ", packed.sizes());
  const int64_t rows = x.size(0), K = x.size(1), blocks = Gated ? packed.size(0) / 2 : packed.size(0), N = blocks * 16;
  TORCH_CHECK(packed.size(1) * 32 == K, "x has ", K, " inputs, the packed weight ", packed.size(1) * 32);
  TORCH_CHECK(rows <= kMaxRows, name, " takes at most ", kMaxRows, " rows, got ", rows);
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->is_contiguous() && bias->size(0) == N && bias->scalar_type() == at::kBFloat16,
                "bias must be contiguous bfloat16 [N = ", N, "]");
  const c10::BFloat16* bp = bias.has_value() ? bias->const_data_ptr<c10::BFloat16>() : nullptr;
  at::Tensor out = at::empty({rows, N}, x.options());
  if (rows == 0) return out;
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  const auto* wp = packed.const_data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t stride = x.stride(0);
  static constexpr ColumnsFn by_blocks[4] = {columns<1, Gated>, columns<2, Gated>, columns<3, Gated>, columns<4, Gated>};
  const ColumnsFn fn = by_blocks[(rows + 15) / 16 - 1];
  at::parallel_for(0, blocks, Gated ? 2 : 4, [&](int64_t begin, int64_t end) { fn(xp, rows, K, stride, wp, bp, begin, end, op, N); });
  return out;
}

}  // namespace

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return run<false>(x, packed, bias, "amx_linear");
}

at::Tensor amx_swiglu(const at::Tensor& x, const at::Tensor& packed) { return run<true>(x, packed, c10::nullopt, "amx_swiglu"); }

#else  // a compiler without the AMX intrinsics
bool cpu_has_amx() { return false; }
at::Tensor amx_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) { TORCH_CHECK(false, "amx_linear needs an x86-64 CPU with AMX-BF16"); }
at::Tensor amx_swiglu(const at::Tensor&, const at::Tensor&) { TORCH_CHECK(false, "amx_swiglu needs an x86-64 CPU with AMX-BF16"); }
#endif

}  // namespace stageserve
