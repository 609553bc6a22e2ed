// Registers the fused CPU ops as torch.ops.stageserve.* (see ops.h).

#include "ops.h"
#include "vec.h"

#include <torch/library.h>

namespace stageserve {

bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("fma");
  return has;
}

bool cpu_has_avx512_bf16() {
  static const bool has = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return has;
}

bool supported(c10::ScalarType dtype, int64_t head_dim, int64_t group) {
  return cpu_has_avx512() && is_kernel_dtype(dtype) && (head_dim == 64 || head_dim == 128) &&
         group >= 1 && group <= 8;
}

}  // namespace stageserve

TORCH_LIBRARY(stageserve, m) {
  m.def("supported(ScalarType dtype, int head_dim, int group) -> bool", &stageserve::supported);
  m.def("paged_decode_attention(Tensor q, Tensor kv, Tensor block_tables, Tensor context_lens, float scale, int window=0, float softcap=0) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_heads_(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, int heads, int kv_heads, float eps) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask, int[] rows) -> ()");
  m.def("gumbel_argmax(Tensor logits, Tensor temperature, Tensor? cutoff, Tensor seed, Tensor step_index) -> Tensor");
  m.def("has_amx() -> bool", &stageserve::cpu_has_amx);
  m.def("has_avx512_vnni() -> bool", &stageserve::cpu_has_avx512_vnni);
  m.def("quant_linear(Tensor x, Tensor packed, Tensor scales, int bits, int input_bits, int scheme=0) -> Tensor");
  m.def("quant_linear_segments(Tensor x, Tensor[] packed, Tensor[] scales, int[] counts, int bits, int input_bits, int scheme=0) -> Tensor");
  m.def("quant_rows(Tensor packed, Tensor scales, Tensor ids, ScalarType dtype) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("amx_swiglu(Tensor x, Tensor packed) -> Tensor");
  m.def("rope_and_cache(Tensor qkv, Tensor cos, Tensor signed_sin, Tensor positions, Tensor(a!) kv, Tensor slot_mapping, int num_heads) -> Tensor");
  m.def("router_logits(Tensor x, Tensor weight) -> Tensor");
  m.def("decode_layers(Tensor(a!) x, Tensor[] input_norms, Tensor[] post_norms, Tensor[] qk_norms, Tensor[] linear_tensors, "
        "int[] linear_meta, int[] moe_meta, Tensor[] routers, Tensor(b!) kv, Tensor[] cos, Tensor[] signed_sin, int[] layer_rope, "
        "int[] windows, Tensor positions, Tensor slot_mapping, Tensor block_tables, int heads, int kv_heads, float scale, float softcap, "
        "float eps) -> ()");
}

TORCH_LIBRARY_IMPL(stageserve, CPU, m) {
  m.impl("paged_decode_attention", &stageserve::paged_decode_attention);
  m.impl("rms_norm", &stageserve::rms_norm);
  m.impl("add_rms_norm", &stageserve::add_rms_norm);
  m.impl("rms_norm_heads_", &stageserve::rms_norm_heads_);
  m.impl("silu_and_mul", &stageserve::silu_and_mul);
  m.impl("argmax_rows", &stageserve::argmax_rows);
  m.impl("apply_token_bitmask_", &stageserve::apply_token_bitmask_);
  m.impl("gumbel_argmax", &stageserve::gumbel_argmax);
  m.impl("quant_linear", &stageserve::quant_linear);
  m.impl("quant_linear_segments", &stageserve::quant_linear_segments);
  m.impl("quant_rows", &stageserve::quant_rows);
  m.impl("amx_linear", &stageserve::amx_linear);
  m.impl("amx_swiglu", &stageserve::amx_swiglu);
  m.impl("rope_and_cache", &stageserve::rope_and_cache);
  m.impl("router_logits", &stageserve::router_logits);
  m.impl("decode_layers", &stageserve::decode_layers);
}
