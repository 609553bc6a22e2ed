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
// then the bias. Per layer: qkv, o, then a dense MLP's gate_up and down, or a mixture of experts'
// gate_up and down of each expert in turn. `moe_meta` holds per layer its experts (0: a dense MLP),
// top k and whether the top k's weights are normalized; `routers` the router of each MoE layer in turn
// (float32 [experts, hidden], moe.cpp's router_logits). A step's chosen experts run together: their
// gate_ups in one quant_linear_segments call, then their downs in another (at 32 rows a layer of 32
// experts made ~56 quant_linear calls one expert at a time, each quantizing its rows and forking threads).

#include "ops.h"

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <c10/util/Exception.h>

#include <vector>

namespace stageserve {

namespace {

// One linear of the flattened lists: its parts on quant_linear, then its bias.
class Linear {
 public:
  struct Part {
    int64_t bits, input_bits, scheme;
    const at::Tensor *packed, *scales;
  };

  // x [T, K] -> [T, N].
  at::Tensor operator()(const at::Tensor& x) const { return segments({this}, x, {x.size(0)}); }

  // linears[i] over the next counts[i] rows of x [M, K] -> [M, N] (quant_linear_segments), the linears
  // alike: as many parts, of the same formats, each with a bias or none.
  static at::Tensor segments(const std::vector<const Linear*>& linears, const at::Tensor& x, const std::vector<int64_t>& counts) {
    const Linear& first = *linears.front();
    std::vector<at::Tensor> outputs;
    for (size_t p = 0; p < first.parts.size(); ++p) {
      std::vector<at::Tensor> packed, scales;
      for (const Linear* linear : linears) {
        TORCH_CHECK(linear->parts.size() == first.parts.size() && (linear->bias == nullptr) == (first.bias == nullptr),
                    "decode_layers: a layer's experts differ in their linears' parts or biases");
        packed.push_back(*linear->parts[p].packed);
        scales.push_back(*linear->parts[p].scales);
      }
      const Part& part = first.parts[p];
      outputs.push_back(quant_linear_segments(x, packed, scales, counts, part.bits, part.input_bits, part.scheme));
    }
    at::Tensor y = outputs.size() == 1 ? outputs[0] : at::cat(outputs, -1);
    if (first.bias != nullptr) {
      int64_t row = 0;
      for (size_t i = 0; i < linears.size(); row += counts[i++]) y.narrow(0, row, counts[i]).add_(*linears[i]->bias);
    }
    return y;
  }

  std::vector<Part> parts;
  const at::Tensor* bias = nullptr;
};

// Every linear of the flattened lists, in order.
std::vector<Linear> read_linears(at::TensorList tensors, at::IntArrayRef meta) {
  size_t t = 0, m = 0;
  auto take_meta = [&]() {
    TORCH_CHECK(m < meta.size(), "decode_layers: linear_meta ends early");
    return meta[m++];
  };
  auto take_tensor = [&]() -> const at::Tensor* {
    TORCH_CHECK(t < tensors.size(), "decode_layers: linear_tensors ends early");
    return &tensors[t++];
  };
  std::vector<Linear> linears;
  while (m < meta.size()) {
    Linear linear;
    const int64_t parts = take_meta(), has_bias = take_meta();
    TORCH_CHECK(parts >= 1, "decode_layers: a linear needs at least one part");
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t bits = take_meta(), input_bits = take_meta(), scheme = take_meta();
      const at::Tensor* packed = take_tensor();
      linear.parts.push_back({bits, input_bits, scheme, packed, take_tensor()});
    }
    if (has_bias) linear.bias = take_tensor();
    linears.push_back(std::move(linear));
  }
  TORCH_CHECK(t == tensors.size(), "decode_layers: linear_tensors holds ", tensors.size() - t, " tensors more than linear_meta names");
  return linears;
}

}  // namespace

void decode_layers(at::Tensor& x, at::TensorList input_norms, at::TensorList post_norms, at::TensorList qk_norms,
                   at::TensorList linear_tensors, at::IntArrayRef linear_meta, at::IntArrayRef moe_meta, at::TensorList routers,
                   const at::Tensor& kv, at::TensorList cos, at::TensorList signed_sin, at::IntArrayRef layer_rope,
                   at::IntArrayRef windows, const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                   int64_t heads, int64_t kv_heads, double scale, double softcap, double eps) {
  const int64_t layers = static_cast<int64_t>(post_norms.size());
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(input_norms.size()) == layers && kv.dim() == 5 && kv.size(0) == layers &&
                  static_cast<int64_t>(layer_rope.size()) == layers && static_cast<int64_t>(windows.size()) == layers &&
                  static_cast<int64_t>(moe_meta.size()) == 3 * layers &&
                  (qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers) && cos.size() == signed_sin.size(),
              "decode_layers: per-layer lists of different lengths (", layers, " post norms)");
  const std::vector<Linear> linears = read_linears(linear_tensors, linear_meta);
  size_t next = 0, next_router = 0;
  auto take = [&]() -> const Linear& {
    TORCH_CHECK(next < linears.size(), "decode_layers: linear_meta holds fewer linears than the layers take");
    return linears[next++];
  };
  const at::Tensor context_lens = at::add(positions, 1);  // each row attends to its own position and all before it
  at::Tensor h = rms_norm(x, input_norms[0], eps);
  for (int64_t i = 0; i < layers; ++i) {
    at::Tensor qkv = take()(h);  // [T, (H + 2K) * D]
    if (!qk_norms.empty()) rms_norm_heads_(qkv, qk_norms[2 * i], qk_norms[2 * i + 1], heads, kv_heads, eps);
    at::Tensor pool = kv.select(0, i);  // [2K, blocks, block_size, D]
    const size_t rope = static_cast<size_t>(layer_rope[i]);
    TORCH_CHECK(rope < cos.size(), "decode_layers: layer ", i, " names RoPE table ", rope, " of ", cos.size());
    at::Tensor qk = rope_and_cache(qkv, cos[rope], signed_sin[rope], positions, pool, slot_mapping, heads);  // [T, H + K, D]
    at::Tensor attention = paged_decode_attention(qk.narrow(1, 0, heads), pool, block_tables, context_lens, scale, windows[i], softcap);
    h = add_rms_norm(x, take()(attention), post_norms[i], eps);
    const int64_t experts = moe_meta[3 * i];
    at::Tensor mlp;
    if (experts == 0) {
      const Linear& gate_up = take();
      mlp = take()(silu_and_mul(gate_up(h)));
    } else {
      TORCH_CHECK(next_router < routers.size() && routers[next_router].size(0) == experts && next + 2 * experts <= linears.size(),
                  "decode_layers: layer ", i, " has ", experts, " experts: its router or their linears are missing");
      const Linear* first = &linears[next];
      mlp = moe_mlp(h, routers[next_router++], moe_meta[3 * i + 1], moe_meta[3 * i + 2] != 0,
                    [first](const std::vector<int64_t>& ids, const at::Tensor& rows, const std::vector<int64_t>& counts) {
                      std::vector<const Linear*> gate_ups, downs;
                      for (const int64_t e : ids) {
                        gate_ups.push_back(&first[2 * e]);
                        downs.push_back(&first[2 * e + 1]);
                      }
                      return Linear::segments(downs, silu_and_mul(Linear::segments(gate_ups, rows, counts)), counts);
                    });
      next += 2 * experts;
    }
    if (i + 1 < layers) h = add_rms_norm(x, mlp, input_norms[i + 1], eps);
    else x.add_(mlp);
  }
  TORCH_CHECK(next == linears.size() && next_router == routers.size(),
              "decode_layers: linear_tensors, linear_meta or routers hold more than ", layers, " layers take");
}

}  // namespace stageserve
