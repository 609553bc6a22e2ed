// Rotary position embedding of the q and k heads (Su et al. 2021, rotate-half pairing as in
// transformers' Llama) and the store of the new keys and values into the paged KV pool (vLLM's
// rotary_embedding + reshape_and_cache), one pass per token instead of the torch path's
// multiply, roll, addcmul, concatenation, transpose and index_copy.

#include "ops.h"
#include "vec.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <cstring>

namespace stageserve {

namespace {

// Rotate one head x[D] by the position's cos / signed sin rows into out[D]: with h = D / 2,
// out[:h] = x[:h] cos[:h] + x[h:] ssin[:h] and out[h:] = x[h:] cos[h:] + x[:h] ssin[h:]
// (the sine table's first half is negated, see model.rope_tables).
template <typename T>
SS_AVX512 SS_INLINE void rotate(const T* __restrict__ x, const T* __restrict__ cos, const T* __restrict__ ssin, T* __restrict__ out, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; i += 16) {
    const __m512 x1 = load16(x + i), x2 = load16(x + h + i);
    store16(out + i, _mm512_fmadd_ps(x2, load16(ssin + i), _mm512_mul_ps(x1, load16(cos + i))));
    store16(out + h + i, _mm512_fmadd_ps(x1, load16(ssin + h + i), _mm512_mul_ps(x2, load16(cos + h + i))));
  }
}

template <typename T>
SS_AVX512 void rope_and_cache_token(const T* __restrict__ qkv, const T* __restrict__ cos, const T* __restrict__ ssin,
                                    T* __restrict__ qk, T* __restrict__ kv, int64_t slot, int64_t H, int64_t K, int64_t D,
                                    int64_t slots_per_head) {
  for (int64_t h = 0; h < H + K; ++h) rotate(qkv + h * D, cos, ssin, qk + h * D, D);
  for (int64_t k = 0; k < K; ++k) {
    T* key = kv + (k * slots_per_head + slot) * D;
    T* value = kv + ((K + k) * slots_per_head + slot) * D;
    std::memcpy(key, qk + (H + k) * D, D * sizeof(T));
    std::memcpy(value, qkv + (H + K + k) * D, D * sizeof(T));
  }
}

}  // namespace

at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                          const at::Tensor& positions, at::Tensor& kv, const at::Tensor& slot_mapping, int64_t num_heads) {
  TORCH_CHECK(kv.dim() == 4 && kv.is_contiguous() && kv.size(0) >= 2 && kv.size(0) % 2 == 0,
              "kv must be a contiguous layer pool [2 * kv_heads, blocks, block_size, head_dim], got ", kv.sizes());
  const int64_t K = kv.size(0) / 2, D = kv.size(3), H = num_heads, T = qkv.size(0);
  TORCH_CHECK(H >= 1, "num_heads must be positive, got ", H);
  TORCH_CHECK(supported(qkv.scalar_type(), D, H % K == 0 ? H / K : 0), "no rope_and_cache kernel for ", qkv.scalar_type(),
              " head_dim ", D, " with ", H, " query and ", K, " kv heads on this CPU");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (H + 2 * K) * D && kv.scalar_type() == qkv.scalar_type(),
              "qkv must be [tokens, (heads + 2 * kv_heads) * head_dim] with contiguous rows, kv's dtype; got ", qkv.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && cos.size(1) == D && signed_sin.sizes() == cos.sizes() &&
                  signed_sin.is_contiguous() && cos.scalar_type() == qkv.scalar_type() && signed_sin.scalar_type() == qkv.scalar_type(),
              "cos and signed_sin must be contiguous [positions, head_dim] of qkv's dtype");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == T &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "positions and slot_mapping must be contiguous int64 [tokens]");
  const int64_t slots_per_head = kv.size(1) * kv.size(2);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {  // bounds once here, so the parallel loop cannot write outside the pool
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "token ", t, ": position ", pos[t], " outside the RoPE table of ", cos.size(0));
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_per_head, "token ", t, ": slot ", slots[t], " outside the pool of ", slots_per_head);
  }
  at::Tensor qk = at::empty({T, H + K, D}, qkv.options());
  dispatch_kernel_dtype(qkv.scalar_type(), [&](auto tag) {
    using S = decltype(tag);
    const S* in = qkv.const_data_ptr<S>();
    const S* c = cos.const_data_ptr<S>();
    const S* s = signed_sin.const_data_ptr<S>();
    S* out = qk.data_ptr<S>();
    S* pool = kv.data_ptr<S>();
    at::parallel_for(0, T, rows_per_thread((H + 2 * K) * D), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        rope_and_cache_token<S>(in + t * qkv.stride(0), c + pos[t] * D, s + pos[t] * D, out + t * (H + K) * D, pool, slots[t], H, K, D, slots_per_head);
    });
  });
  return qk;
}

}  // namespace stageserve
