// Consecutive decoder layers of a decode step in one call (CPU, B <= 16 rows, bf16 or fp32): per layer
// the attention block (attn_decode_out) and the MoE block (moe_block_glu_decode_out), the same functions
// with the same arguments as the layer-by-layer path, so the same numbers. A DecodeStack holds each
// layer's weights and settings (added once by dynamoe.models.decode_plan); a step passes only what changes
// from step to step. Between layers nothing returns to Python: at ~0.1 ms of interpreter work per layer
// (more once the weights streaming through have evicted the interpreter's own data from the caches) that
// was a tenth of a small model's step. Registered in packed_gemv.cpp's module.
#include <torch/extension.h>
#include <cstdint>
#include <vector>
#include "decode_ops.h"

namespace {
using OptTensor = c10::optional<torch::Tensor>;

struct Layer {
  // attention block (attn_decode_out's arguments but the step's)
  torch::Tensor attn_norm_w;
  double attn_eps;
  bool attn_norm_fp32;
  torch::Tensor w_qkv;
  OptTensor b_qkv, q_norm, k_norm;
  double qk_eps;
  bool interleaved;
  int64_t window;
  OptTensor sinks;
  double scale;
  torch::Tensor w_o;
  OptTensor b_o;
  // MoE block (moe_block_glu_decode_out's arguments but h, out and load)
  torch::Tensor moe_norm_w;
  double moe_eps;
  bool moe_norm_fp32;
  torch::Tensor gate_w;
  OptTensor gate_bias, sel_bias;
  int64_t kind;
  bool renormalize;
  double route_scale;
  int64_t n_group, topk_group, top_k;
  torch::Tensor w_gate_up, w_down;
  OptTensor b_gate_up, b_down;
  int64_t act;
  double alpha, limit;
};

class DecodeStack {
 public:
  void add_layer(torch::Tensor attn_norm_w, double attn_eps, bool attn_norm_fp32, torch::Tensor w_qkv, OptTensor b_qkv,
                 OptTensor q_norm, OptTensor k_norm, double qk_eps, bool interleaved, int64_t window, OptTensor sinks,
                 double scale, torch::Tensor w_o, OptTensor b_o, torch::Tensor moe_norm_w, double moe_eps,
                 bool moe_norm_fp32, torch::Tensor gate_w, OptTensor gate_bias, OptTensor sel_bias, int64_t kind,
                 bool renormalize, double route_scale, int64_t n_group, int64_t topk_group, int64_t top_k,
                 torch::Tensor w_gate_up, torch::Tensor w_down, OptTensor b_gate_up, OptTensor b_down, int64_t act,
                 double alpha, double limit) {
    TORCH_CHECK(w_gate_up.dim() == 3, "w_gate_up must be [E, 2F, D]");
    TORCH_CHECK(layers_.empty() || w_gate_up.size(0) == layers_.front().w_gate_up.size(0),
                "every layer of a DecodeStack must have the same number of experts");
    layers_.push_back(Layer{attn_norm_w, attn_eps, attn_norm_fp32, w_qkv, b_qkv, q_norm, k_norm, qk_eps, interleaved,
                            window, sinks, scale, w_o, b_o, moe_norm_w, moe_eps, moe_norm_fp32, gate_w, gate_bias,
                            sel_bias, kind, renormalize, route_scale, n_group, topk_group, top_k, w_gate_up, w_down,
                            b_gate_up, b_down, act, alpha, limit});
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // h [B, D] -> out [B, D] through every layer; k_caches/v_caches: each layer's paged [K, blocks, block_size, d]
  // (one block_table [slots, blocks per slot] for all);
  // loads [layers, E] int64 filled row by row; returns each layer's max load
  std::vector<int64_t> run(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                           torch::Tensor positions, std::vector<torch::Tensor> k_caches,
                           std::vector<torch::Tensor> v_caches, torch::Tensor block_table, torch::Tensor loads,
                           torch::Tensor out) {
    const int64_t N = size();
    TORCH_CHECK(N > 0, "the DecodeStack has no layers");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == N && static_cast<int64_t>(v_caches.size()) == N,
                "k_caches and v_caches must hold one tensor per layer (", N, ")");
    TORCH_CHECK(loads.dim() == 2 && loads.size(0) == N && loads.size(1) == layers_.front().w_gate_up.size(0) &&
                loads.scalar_type() == torch::kLong && loads.is_contiguous(),
                "loads must be contiguous int64 [", N, ", ", layers_.front().w_gate_up.size(0), "]");
    TORCH_CHECK(out.sizes() == h.sizes() && out.scalar_type() == h.scalar_type() && out.is_contiguous() &&
                !out.is_same(h), "out must be a contiguous [B, D] tensor of h's dtype, not h itself");
    std::vector<int64_t> max_loads(N);
    torch::Tensor a = torch::empty_like(h), x = h;
    torch::Tensor ping[2] = {torch::empty_like(h), torch::empty_like(h)};
    for (int64_t i = 0; i < N; ++i) {
      const Layer& l = layers_[i];
      attn_decode_out(x, l.attn_norm_w, l.attn_eps, l.attn_norm_fp32, l.w_qkv, l.b_qkv, l.q_norm, l.k_norm, l.qk_eps,
                      cos, sin, l.interleaved, k_caches[i], v_caches[i], block_table, slots, positions, l.window,
                      l.sinks, l.scale, l.w_o, l.b_o, a);
      torch::Tensor y = i == N - 1 ? out : ping[i % 2];
      max_loads[i] = moe_block_glu_decode_out(a, l.moe_norm_w, l.moe_eps, l.moe_norm_fp32, l.gate_w, l.gate_bias,
                                              l.sel_bias, l.kind, l.renormalize, l.route_scale, l.n_group,
                                              l.topk_group, l.top_k, l.w_gate_up, l.w_down, l.b_gate_up, l.b_down,
                                              l.act, l.alpha, l.limit, y, loads[i]);
      x = y;
    }
    return max_loads;
  }

 private:
  std::vector<Layer> layers_;
};
}  // namespace

void register_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack",
                                "consecutive decoder layers (fused attention + GLU MoE blocks) of a decode step in one "
                                "call: add_layer(attention args..., MoE args...) once, run(...) per step")
      .def(pybind11::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("__len__", &DecodeStack::size)
      .def("run", &DecodeStack::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}
