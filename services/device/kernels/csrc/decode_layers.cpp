// The decoder layers of a decode-only step in one call: the same ops, in the same order, as the
// model's fused path in Python (decoder.py `_layers_fused`), for layers whose linears all run on the
// VNNI kernel. Why: each op called from Python releases the GIL and takes it back, ~10 times a layer;
// served, the device's other Python threads (its gRPC streams' handlers, the completion lane) take
// it in between, and the compute thread waits for it on its return (on a 2-core AMD EPYC at one
// stream, ~18 blocking waits and ~1.4 ms a token: docs/benchmarks.md). One call releases it once.
//
// A linear comes flattened (fused_decode.py `FusedDecodeLayers`): in `linear_meta`, its number of parts
// (a stacked weight's row ranges, their outputs side by side), whether it has a bias, then per part
// bits, input_bits and scheme (quant_linear's); in `linear_tensors`, per part packed and scales,
// then the bias. Per layer: qkv, o, gate_up, down.

#include "ops.h"

#include <ATen/ops/cat.h>
#include <c10/util/Exception.h>

#include <vector>

namespace stageserve {

namespace {

// Reads the flattened linears in order.
class Linears {
 public:
  Linears(at::TensorList tensors, at::IntArrayRef meta) : tensors_(tensors), meta_(meta) {}

  // x [T, K] -> [T, N] through the next linear.
  at::Tensor next(const at::Tensor& x) {
    const int64_t parts = take_meta(), has_bias = take_meta();
    TORCH_CHECK(parts >= 1, "decode_layers: a linear needs at least one part");
    std::vector<at::Tensor> outputs;
    outputs.reserve(parts);
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t bits = take_meta(), input_bits = take_meta(), scheme = take_meta();
      const at::Tensor& packed = take_tensor();
      const at::Tensor& scales = take_tensor();
      outputs.push_back(quant_linear(x, packed, scales, bits, input_bits, scheme));
    }
    at::Tensor y = parts == 1 ? outputs[0] : at::cat(outputs, -1);
    if (has_bias) y.add_(take_tensor());
    return y;
  }

  bool done() const { return t_ == tensors_.size() && m_ == meta_.size(); }

 private:
  int64_t take_meta() {
    TORCH_CHECK(m_ < meta_.size(), "decode_layers: linear_meta ends early");
    return meta_[m_++];
  }
  const at::Tensor& take_tensor() {
    TORCH_CHECK(t_ < tensors_.size(), "decode_layers: linear_tensors ends early");
    return tensors_[t_++];
  }

  at::TensorList tensors_;
  at::IntArrayRef meta_;
  size_t t_ = 0, m_ = 0;
};

}  // namespace

void decode_layers(at::Tensor& x, const at::Tensor& h_first, at::TensorList input_norms, at::TensorList post_norms,
                         at::TensorList qk_norms, at::TensorList linear_tensors, at::IntArrayRef linear_meta, const at::Tensor& kv,
                         at::TensorList cos, at::TensorList signed_sin, at::IntArrayRef layer_rope, at::IntArrayRef windows,
                         const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t heads, int64_t kv_heads, double scale, double softcap, double eps) {
  const int64_t layers = static_cast<int64_t>(post_norms.size());
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(input_norms.size()) == layers && kv.dim() == 5 && kv.size(0) == layers &&
                  static_cast<int64_t>(layer_rope.size()) == layers && static_cast<int64_t>(windows.size()) == layers &&
                  (qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers) && cos.size() == signed_sin.size(),
              "decode_layers: per-layer lists of different lengths (", layers, " post norms)");
  Linears linears(linear_tensors, linear_meta);
  at::Tensor h = h_first;
  for (int64_t i = 0; i < layers; ++i) {
    at::Tensor qkv = linears.next(h);  // [T, (H + 2K) * D]
    if (!qk_norms.empty()) rms_norm_heads_(qkv, qk_norms[2 * i], qk_norms[2 * i + 1], heads, kv_heads, eps);
    at::Tensor pool = kv.select(0, i);  // [2K, blocks, block_size, D]
    const size_t rope = static_cast<size_t>(layer_rope[i]);
    TORCH_CHECK(rope < cos.size(), "decode_layers: layer ", i, " names RoPE table ", rope, " of ", cos.size());
    at::Tensor qk = rope_and_cache(qkv, cos[rope], signed_sin[rope], positions, pool, slot_mapping, heads);  // [T, H + K, D]
    at::Tensor attention = paged_decode_attention(qk.narrow(1, 0, heads), pool, block_tables, context_lens, scale, windows[i], softcap);
    h = add_rms_norm(x, linears.next(attention), post_norms[i], eps);
    at::Tensor mlp = linears.next(silu_and_mul(linears.next(h)));
    if (i + 1 < layers) h = add_rms_norm(x, mlp, input_norms[i + 1], eps);
    else x.add_(mlp);
  }
  TORCH_CHECK(linears.done(), "decode_layers: linear_tensors or linear_meta holds more than ", layers, " layers' linears");
}

}  // namespace stageserve
