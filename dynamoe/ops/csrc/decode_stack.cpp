// Consecutive decoder layers of a decode step in one call (CPU, 1..kMaxRows rows, bf16 or fp32): per layer
// the attention block (attn_decode_out) and the MoE block (moe_decode_out), the same functions with the
// same weights as the layer-by-layer path, so the same numbers. A DecodeStack holds each layer's
// AttentionWeights and MoEWeights (decode_weights.h; added once by dynamoe.models.decode_plan); a step
// passes only what changes from step to step. Between layers nothing returns to Python: at ~0.1 ms of
// interpreter work per layer (more once the weights streaming through have evicted the interpreter's own
// data from the caches) that was a tenth of a small model's step.
// Also binds the weight structs, the enums (decode_enums_bind.h) and the row limit of decode_weights.h, and
// the two block ops.
#include <torch/extension.h>
#include <cstdint>
#include <vector>
#include "decode_ops.h"
#include "decode_enums_bind.h"

namespace {
using dynamoe::AttentionWeights;
using dynamoe::MoEWeights;

struct Layer {
  AttentionWeights attn;
  MoEWeights moe;
};

class DecodeStack {
 public:
  void add_layer(const AttentionWeights& attn, const MoEWeights& moe) {
    TORCH_CHECK(attn.norm_w.defined() && (attn.qkv.size() == 1 || attn.qkv.size() == 3) && attn.o.w.defined(),
                "AttentionWeights needs norm_w, qkv (one stacked projection, or q, k and v) and o");
    TORCH_CHECK(!moe.routed || (moe.gate_w.defined() && moe.w1.defined() && moe.w2.defined()),
                "MoEWeights needs gate_w, w1 and w2 (or routed = false)");
    TORCH_CHECK(moe.routed || moe.shared_w1.has_value(), "a dense layer's MoEWeights needs shared_w1 and shared_w2");
    TORCH_CHECK(moe.residual && moe.norm_w.has_value(), "a DecodeStack layer's MoEWeights has its norm and residual");
    TORCH_CHECK(!moe.routed || experts_ == 0 || moe.num_experts() == experts_,
                "every routed layer of a DecodeStack must have the same number of experts");
    if (moe.routed) experts_ = moe.num_experts();
    layers_.push_back(Layer{attn, moe});
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }
  int64_t experts() const { return experts_; }

  // h [B, D] -> out [B, D] through every layer; k_caches/v_caches: each layer's paged [K, blocks, block_size, d]
  // (one block_table [slots, blocks per slot] for all);
  // loads [layers, E] int64: the routed layers' rows filled; returns each layer's max load (0 for dense layers)
  std::vector<int64_t> run(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                           torch::Tensor positions, std::vector<torch::Tensor> k_caches,
                           std::vector<torch::Tensor> v_caches, torch::Tensor block_table, torch::Tensor loads,
                           torch::Tensor out) {
    const int64_t N = size();
    TORCH_CHECK(N > 0, "the DecodeStack has no layers");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == N && static_cast<int64_t>(v_caches.size()) == N,
                "k_caches and v_caches must hold one tensor per layer (", N, ")");
    const int64_t E = experts_;
    TORCH_CHECK(loads.dim() == 2 && loads.size(0) == N && loads.size(1) == E && loads.scalar_type() == torch::kLong &&
                loads.is_contiguous(), "loads must be contiguous int64 [", N, ", ", E, "]");
    TORCH_CHECK(out.sizes() == h.sizes() && out.scalar_type() == h.scalar_type() && out.is_contiguous() &&
                !out.is_same(h), "out must be a contiguous [B, D] tensor of h's dtype, not h itself");
    std::vector<int64_t> max_loads(N);
    torch::Tensor a = torch::empty_like(h), x = h;
    torch::Tensor ping[2] = {torch::empty_like(h), torch::empty_like(h)};
    for (int64_t i = 0; i < N; ++i) {
      const Layer& l = layers_[i];
      attn_decode_out(x, l.attn, cos, sin, k_caches[i], v_caches[i], block_table, slots, positions, a);
      torch::Tensor y = i == N - 1 ? out : ping[i % 2];
      torch::Tensor load = l.moe.routed ? loads[i] : torch::Tensor();
      max_loads[i] = moe_decode_out(a, l.moe, y, load);
      x = y;
    }
    return max_loads;
  }

 private:
  std::vector<Layer> layers_;
  int64_t experts_ = 0;  // the routed layers' expert count (0: none yet)
};

template <typename T>
void bind_linear(pybind11::class_<T>& c) {
  c.def(pybind11::init<>())
      .def_readwrite("format", &T::format).def_readwrite("w", &T::w).def_readwrite("scale", &T::scale)
      .def_readwrite("global_scale", &T::global_scale).def_readwrite("blk0", &T::blk0).def_readwrite("blk1", &T::blk1)
      .def_readwrite("bias", &T::bias).def_readwrite("acts", &T::acts)
      .def_property_readonly("out_features", &T::out_features);
}

template <typename T>
void bind_attention(pybind11::class_<T>& c) {
  c.def(pybind11::init<>())
      .def_readwrite("norm_w", &T::norm_w).def_readwrite("norm_eps", &T::norm_eps)
      .def_readwrite("norm_fp32", &T::norm_fp32).def_readwrite("norm_zero_centered", &T::norm_zero_centered)
      .def_readwrite("qkv", &T::qkv)
      .def_readwrite("q_norm", &T::q_norm).def_readwrite("k_norm", &T::k_norm).def_readwrite("qk_eps", &T::qk_eps)
      .def_readwrite("qk_fp32", &T::qk_fp32).def_readwrite("qk_zero_centered", &T::qk_zero_centered)
      .def_readwrite("rope", &T::rope).def_readwrite("interleaved", &T::interleaved).def_readwrite("window", &T::window)
      .def_readwrite("sinks", &T::sinks).def_readwrite("scale", &T::scale).def_readwrite("gate_kind", &T::gate_kind)
      .def_readwrite("gate_per_head", &T::gate_per_head).def_readwrite("gate", &T::gate).def_readwrite("o", &T::o);
}

template <typename T>
void bind_moe(pybind11::class_<T>& c) {
  c.def(pybind11::init<>())
      .def_readwrite("norm_w", &T::norm_w).def_readwrite("norm_eps", &T::norm_eps)
      .def_readwrite("norm_fp32", &T::norm_fp32).def_readwrite("norm_zero_centered", &T::norm_zero_centered)
      .def_readwrite("residual", &T::residual)
      .def_readwrite("gate_w", &T::gate_w).def_readwrite("gate_bias", &T::gate_bias)
      .def_readwrite("sel_bias", &T::sel_bias).def_readwrite("router", &T::router)
      .def_readwrite("renormalize", &T::renormalize).def_readwrite("route_scale", &T::route_scale)
      .def_readwrite("n_group", &T::n_group).def_readwrite("topk_group", &T::topk_group)
      .def_readwrite("top_k", &T::top_k).def_readwrite("kind", &T::kind).def_readwrite("format", &T::format)
      .def_readwrite("act", &T::act).def_readwrite("alpha", &T::alpha).def_readwrite("limit", &T::limit)
      .def_readwrite("w1", &T::w1).def_readwrite("w2", &T::w2).def_readwrite("b1", &T::b1).def_readwrite("b2", &T::b2)
      .def_readwrite("w1b", &T::w1b).def_readwrite("w1c", &T::w1c).def_readwrite("w2b", &T::w2b)
      .def_readwrite("w2c", &T::w2c).def_readwrite("blk0", &T::blk0).def_readwrite("blk1", &T::blk1)
      .def_readwrite("bf16_acts", &T::bf16_acts).def_readwrite("acts", &T::acts)
      .def_readwrite("shared_w1", &T::shared_w1)
      .def_readwrite("shared_w2", &T::shared_w2).def_readwrite("shared_b1", &T::shared_b1)
      .def_readwrite("shared_b2", &T::shared_b2).def_readwrite("shared_gate", &T::shared_gate)
      .def_readwrite("shared_act", &T::shared_act).def_readwrite("shared_alpha", &T::shared_alpha)
      .def_readwrite("shared_limit", &T::shared_limit).def_readwrite("routed", &T::routed)
      .def_property_readonly("num_experts", &T::num_experts);
}
}  // namespace

void register_decode_stack(pybind11::module& m) {
  namespace py = pybind11;
  bind_decode_enums(m);
  py::class_<dynamoe::LinearWeights> linear(m, "LinearWeights", "one Linear, dense or packed (decode_weights.h)");
  bind_linear(linear);
  py::class_<AttentionWeights> attn(m, "AttentionWeights", "what a fused attention block reads (decode_weights.h)");
  bind_attention(attn);
  py::class_<MoEWeights> moe(m, "MoEWeights", "what a fused MoE layer / block reads (decode_weights.h)");
  bind_moe(moe);
  m.def("attn_decode_out", &attn_decode_out, py::call_guard<py::gil_scoped_release>(),
        "a decode step of B <= MAX_ROWS sequences through an attention block: out = h + o_proj(attention(RoPE(qk-norm("
        "qkv(x)))) [* act(gate(x))]), x = norm(h), with k/v written into the paged cache [K, blocks, block_size, d] "
        "at (slots, positions) "
        "through block_table [slots, blocks per slot]",
        py::arg("h"), py::arg("weights"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_table"), py::arg("slots"), py::arg("positions"), py::arg("out"));
  m.def("moe_decode_out", &moe_decode_out, py::call_guard<py::gil_scoped_release>(),
        "a decode step of T <= MAX_ROWS rows through an MoE layer: out = [h +] experts(route([RMSNorm](h))); "
        "load [E] filled; returns the max load",
        py::arg("h"), py::arg("weights"), py::arg("out"), py::arg("load"));
  py::class_<DecodeStack>(m, "DecodeStack",
                          "consecutive decoder layers (fused attention + MoE blocks) of a decode step in one call: "
                          "add_layer(AttentionWeights, MoEWeights) once, run(...) per step")
      .def(py::init<>())
      .def("add_layer", &DecodeStack::add_layer, py::arg("attention"), py::arg("moe"))
      .def("__len__", &DecodeStack::size)
      .def_property_readonly("experts", &DecodeStack::experts)
      .def("run", &DecodeStack::run, py::call_guard<py::gil_scoped_release>());
}
