// A decode step through an MoE layer in one call (CPU, 1..kMaxRows rows, bf16 or fp32), reading its
// MoEWeights (decode_weights.h): the optional RMSNorm before the router (a decoder layer's post-attention
// norm), the router (route_decode_out), the routed experts -- GLU or FFN in bf16/fp32
// (moe_glu_decode_out / moe_ffn_decode_out) or GLU with packed FP8/MXFP4/NVFP4/INT4 weights
// (packed_moe_glu_decode_out, fp32 out rounded to h's dtype) --, the shared experts (a one-expert GLU
// call, optionally scaled by a sigmoid gate) added to them, and the optional residual; or, for a dense
// layer, the shared part alone. Each piece rounds to h's dtype where the per-op path does, without
// returning to Python between them. Registered in decode_stack.cpp.
#include <torch/extension.h>
#include <cmath>
#include <cstdint>
#include "decode_ops.h"

namespace {
template <typename scalar_t>
void add_rows(const scalar_t* a, const scalar_t* b, int64_t n, scalar_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<scalar_t>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

// y [T, O] of h's dtype = the routed experts of x for the router's (ids, weights)
int64_t experts(const dynamoe::MoEWeights& w, const torch::Tensor& x, const torch::Tensor& ids,
                const torch::Tensor& weights, torch::Tensor& y, torch::Tensor& load) {
  if (w.format == dynamoe::kDense) {
    if (w.kind == dynamoe::kGlu)
      return moe_glu_decode_out(x, ids, weights, w.w1, w.w2, w.b1, w.b2, w.act, w.alpha, w.limit, y, load);
    return moe_ffn_decode_out(x, ids, weights, w.w1, w.w2, w.b1, w.b2, w.act, y, load);
  }
  TORCH_CHECK(w.kind == dynamoe::kGlu, "packed expert weights are GLU experts only");
  auto xin = w.bf16_acts ? x : x.to(torch::kFloat).contiguous();
  auto y32 = y.scalar_type() == torch::kFloat ? y : torch::empty(y.sizes(), y.options().dtype(torch::kFloat));
  const int64_t max_load = packed_moe_glu_decode_out(w.format, xin, ids, weights, w.w1, w.w1b, w.w1c, w.w2, w.w2b,
                                                     w.w2c, w.blk0, w.blk1, w.b1, w.b2, w.act, w.alpha, w.limit, y32,
                                                     load, w.bf16_acts, w.acts);
  if (!y32.is_same(y)) y.copy_(y32);
  return max_load;
}
// y [T, O] = (y +) the shared experts of x (rounded to h's dtype after each step, as the per-op path)
template <typename scalar_t>
void add_shared(const dynamoe::MoEWeights& w, const torch::Tensor& x, torch::Tensor& y, bool add) {
  const int64_t T = x.size(0), D = x.size(1);
  auto ids = torch::zeros({T, 1}, x.options().dtype(torch::kLong));
  auto ones = torch::ones({T, 1}, x.options().dtype(torch::kFloat));
  auto load = torch::empty({1}, x.options().dtype(torch::kLong));
  auto ys = add ? torch::empty_like(y) : y;
  moe_glu_decode_out(x, ids, ones, *w.shared_w1, *w.shared_w2, w.shared_b1, w.shared_b2, w.shared_act,
                     w.shared_alpha, w.shared_limit, ys, load);
  const int64_t O = ys.size(1);
  scalar_t* sp = ys.data_ptr<scalar_t>();
  if (w.shared_gate.has_value()) {
    const torch::Tensor& g = *w.shared_gate;
    TORCH_CHECK(g.numel() == D && g.is_contiguous() && g.scalar_type() == x.scalar_type(),
                "shared_gate must be contiguous [1, ", D, "] of h's dtype");
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* xp = x.data_ptr<scalar_t>();
    for (int64_t t = 0; t < T; ++t) {
      float logit = 0.f;
      for (int64_t i = 0; i < D; ++i) logit += static_cast<float>(xp[t * D + i]) * static_cast<float>(gp[i]);
      const float l = static_cast<float>(static_cast<scalar_t>(logit));
      const float s = static_cast<float>(static_cast<scalar_t>(1.f / (1.f + std::exp(-l))));
      for (int64_t o = 0; o < O; ++o) sp[t * O + o] = static_cast<scalar_t>(s * static_cast<float>(sp[t * O + o]));
    }
  }
  if (add) add_rows(y.data_ptr<scalar_t>(), static_cast<const scalar_t*>(sp), T * O, y.data_ptr<scalar_t>());
}

// y [T, O] = the routed experts (+ shared) of x
int64_t mlp(const dynamoe::MoEWeights& w, const torch::Tensor& x, torch::Tensor& y, torch::Tensor& load) {
  int64_t max_load = 0;
  if (w.routed) {
    const int64_t T = x.size(0);
    auto ids = torch::empty({T, w.top_k}, x.options().dtype(torch::kLong));
    auto weights = torch::empty({T, w.top_k}, x.options().dtype(torch::kFloat));
    route_decode_out(x, w.gate_w, w.gate_bias, w.sel_bias, w.router, w.renormalize, w.route_scale, w.n_group,
                     w.topk_group, ids, weights);
    max_load = experts(w, x, ids, weights, y, load);
  }
  if (w.shared_w1.has_value()) {
    if (x.scalar_type() == torch::kBFloat16) add_shared<c10::BFloat16>(w, x, y, w.routed);
    else add_shared<float>(w, x, y, w.routed);
  }
  return max_load;
}
}  // namespace

int64_t moe_decode_out(torch::Tensor h, const dynamoe::MoEWeights& w, torch::Tensor out, torch::Tensor load) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.device().is_cpu() && h.size(0) >= 1 &&
              h.size(0) <= dynamoe::kMaxRows && (h.scalar_type() == torch::kBFloat16 || h.scalar_type() == torch::kFloat),
              "h must be a contiguous bf16 or fp32 CPU tensor [T, D] with 1 <= T <= ", dynamoe::kMaxRows);
  TORCH_CHECK(!w.routed || (w.gate_w.defined() && w.w1.defined() && w.w2.defined()),
              "MoEWeights needs gate_w, w1 and w2 (or routed = false)");
  TORCH_CHECK(w.shared_w1.has_value() == w.shared_w2.has_value() && (w.routed || w.shared_w1.has_value()),
              "MoEWeights needs shared_w1 and shared_w2 together (and them when routed = false)");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == h.size(0) && out.is_contiguous() && out.scalar_type() == h.scalar_type() &&
              !out.is_same(h), "out must be a contiguous [T, O] tensor of h's dtype, not h itself");
  TORCH_CHECK(!w.residual || out.sizes() == h.sizes(), "with the residual the experts' output dim must equal D");
  torch::Tensor x = h;
  if (w.norm_w.has_value()) {
    x = torch::empty_like(h);
    rms_norm_out(h, *w.norm_w, w.norm_eps, w.norm_fp32, x, w.norm_zero_centered);
  }
  if (!w.residual) return mlp(w, x, out, load);
  auto y = torch::empty_like(h);
  const int64_t max_load = mlp(w, x, y, load);
  if (h.scalar_type() == torch::kBFloat16)
    add_rows(h.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), h.numel(), out.data_ptr<c10::BFloat16>());
  else
    add_rows(h.data_ptr<float>(), y.data_ptr<float>(), h.numel(), out.data_ptr<float>());
  return max_load;
}
