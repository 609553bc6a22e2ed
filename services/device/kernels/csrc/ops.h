// The fused CPU ops of stageserve's device (torch.ops.stageserve.*), registered in registration.cpp.
// Each needs an x86-64 CPU with AVX-512 F/BW/DQ/VL and FMA; `supported` says whether this CPU,
// dtype (bfloat16 or float32) and head shape have them; the amx_* ops need AMX-BF16 as well
// (`cpu_has_amx`). On a CPU without them they raise, and the model keeps its pure-torch path (or
// oneDNN's linears); on other architectures the library is not built at all (cpu_kernels.py).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace stageserve {

bool supported(c10::ScalarType dtype, int64_t head_dim, int64_t group);
bool cpu_has_amx();  // AMX-BF16 present and granted to this process  (amx_linear.cpp)

// x [M <= 64, K] @ W^T (+ bias [N]) -> [M, N] bfloat16 on AMX, W packed [N / 16, K / 32, 16, 32]  (amx_linear.cpp)
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
// silu(x @ Wg^T) * (x @ Wu^T) -> [M, I] on AMX, [Wg; Wu] packed by amx_pack_gated  (amx_linear.cpp)
at::Tensor amx_swiglu(const at::Tensor& x, const at::Tensor& packed);

// [B, H, D] queries over paged contexts (each row's last `window` tokens; window 0: all; scores soft-capped
// at `softcap`, 0: none) -> [B, H * D]  (paged_attention.cpp)
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t window, double softcap);

// RMSNorm of x [T, hidden] -> new tensor; add_rms_norm first adds delta into residual in place  (norm.cpp)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps);
// RMSNorm of each query head of qkv [T, (H + 2K) * D] by q_weight [D] and each key head by k_weight, in place  (norm.cpp)
void rms_norm_heads_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, int64_t heads, int64_t kv_heads, double eps);

// the index [S] int64 of each row's maximum in logits [S, V]: the first one, or the first NaN  (sampling.cpp)
at::Tensor argmax_rows(const at::Tensor& x);

// the sampled index [S] int64 of each row: argmax(clamp(logits / temperature) (-inf below cutoff) - log(E)),
// E ~ Exp(1) from the sampler's SplitMix64 noise of (seed, step_index, token); logits [S, V] bfloat16 or
// float32, temperature and cutoff [S] float32, seed and step_index [S] int64  (sampling.cpp)
at::Tensor gumbel_argmax(const at::Tensor& logits, const at::Tensor& temperature, const c10::optional<at::Tensor>& cutoff,
                         const at::Tensor& seed, const at::Tensor& step_index);

// logits[r] = -inf where bit t % 32 of bitmask[r][t / 32] is 0, for each r in rows; logits [S, V]
// bfloat16 or float32, bitmask [S, ceil(V / 32)] int32 (xgrammar's token bitmask)  (sampling.cpp)
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, at::IntArrayRef rows);

// x [M, K] @ W^T -> [M, N] for 4-, 5-, 6- or 8-bit weights packed in 16-row panels of 32-input groups
// ([N / 16, K / 32, 64 * bits] uint8) with per-group float16 scales (scheme 0: d and m [N / 16, K / 32, 2, 16];
// scheme 3: d [N / 16, K / 32, 16], m = -2^(bits - 1) d) or K-quant super-block scales (scheme 1, Q4_K/Q5_K:
// uint8 [N / 16, K / 256, 320]; scheme 2, Q6_K: uint8 [N / 16, K / 256, 288]), x quantized per row to
// int8 groups of 32 (input_bits 8) or two int8 levels, a 257th of the first's step (16); needs
// AVX512-VNNI (`cpu_has_avx512_vnni`)  (quant_linear.cpp)
bool cpu_has_avx512_vnni();
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t bits, int64_t input_bits,
                        int64_t scheme);
// quant_linear of consecutive row segments of x [M, K], each through its own weight (a mixture's experts over
// the rows routed to them, sorted by expert): rows [c_0 + ... + c_{i-1}, + c_i) through packed[i], scales[i],
// every weight of the same format and N -> [M, N]; x quantized once and every segment's panels in one
// parallel region, each row's result bit for bit quant_linear's of it alone  (quant_linear.cpp)
at::Tensor quant_linear_segments(const at::Tensor& x, at::TensorList packed, at::TensorList scales, at::IntArrayRef counts, int64_t bits,
                                 int64_t input_bits, int64_t scheme);
// Rows ids [T] int64 of an 8-bit weight packed as quant_linear takes it (scheme 0 or 3), dequantized (d * q in float32,
// rounded once) -> [T, K] of dtype: a tied embedding table looked up in the LM head's int8 panels  (quant_linear.cpp)
at::Tensor quant_rows(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& ids, c10::ScalarType dtype);

// silu(gate) * up of [T, 2 * I] -> [T, I]  (activation.cpp)
at::Tensor silu_and_mul(const at::Tensor& gate_up);

// RoPE on the q and k heads of qkv [T, (H + 2K) * D] -> [T, H + K, D]; k and v stored into the
// layer's pool [2K, blocks, block_size, D] at slot_mapping [T]  (rope_cache.cpp)
at::Tensor rope_and_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin,
                          const at::Tensor& positions, at::Tensor& kv, const at::Tensor& slot_mapping, int64_t num_heads);

// A mixture of experts' router: x [T, K] bfloat16 or float32 @ W^T, W float32 [E, K] -> float32 [T, E],
// each dot summed in float32 in one fixed order  (moe.cpp)
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& weight);
// The mixture of experts of x [T, hidden] (model/moe.py's softmax `route` and `grouped_experts`, the
// same ops): `router` as router_logits takes it, each row's top_k experts (their weights normalized to
// sum 1 with `normalize`), run_experts(ids, rows [A, hidden], counts) -> [A, hidden]: expert ids[i] over the next
// counts[i] rows (the rows sorted by expert); -> [T, hidden] in x's dtype  (moe.cpp)
using ExpertsFn = std::function<at::Tensor(const std::vector<int64_t>&, const at::Tensor&, const std::vector<int64_t>&)>;
at::Tensor moe_mlp(const at::Tensor& x, const at::Tensor& router, int64_t top_k, bool normalize, const ExpertsFn& run_experts);

// The decoder layers of a decode-only step ([T, hidden] residual x, the embeddings, updated in place), each
// layer's linears on quant_linear, its MLP dense or a mixture of experts, flattened as decode_layers.cpp
// describes  (decode_layers.cpp)
void decode_layers(at::Tensor& x, at::TensorList input_norms, at::TensorList post_norms, at::TensorList qk_norms,
                   at::TensorList linear_tensors, at::IntArrayRef linear_meta, at::IntArrayRef moe_meta, at::TensorList routers,
                   const at::Tensor& kv, at::TensorList cos, at::TensorList signed_sin, at::IntArrayRef layer_rope,
                   at::IntArrayRef windows, const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                   int64_t heads, int64_t kv_heads, double scale, double softcap, double eps);

}  // namespace stageserve
