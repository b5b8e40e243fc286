// A decode step's whole MoE sub-block in one call (CPU, T <= 16 rows, bf16 or fp32): the residual
// stream h [T, D] -> out = h + experts(route(norm(h))), i.e. the post-attention RMSNorm, the router
// (route_decode_out) and the routed GLU experts (moe_glu_decode_out) with the residual added -- the same
// functions, in the same order and with the same roundings as the per-op calls, without returning to
// Python between them. Registered in packed_gemv.cpp's module.
#include <torch/extension.h>
#include <cstdint>
#include "decode_ops.h"

namespace {
template <typename scalar_t>
void add_rows(const scalar_t* a, const scalar_t* b, int64_t n, scalar_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<scalar_t>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}
}  // namespace

int64_t moe_block_glu_decode_out(torch::Tensor h, torch::Tensor norm_w, double norm_eps, bool norm_weight_fp32,
                                 torch::Tensor gate_w, c10::optional<torch::Tensor> gate_bias,
                                 c10::optional<torch::Tensor> sel_bias, int64_t kind, bool renormalize, double scale,
                                 int64_t n_group, int64_t topk_group, int64_t top_k, torch::Tensor w_gate_up,
                                 torch::Tensor w_down, c10::optional<torch::Tensor> b_gate_up,
                                 c10::optional<torch::Tensor> b_down, int64_t act, double alpha, double limit,
                                 torch::Tensor out, torch::Tensor load) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.device().is_cpu() && h.size(0) >= 1 && h.size(0) <= 16 &&
              (h.scalar_type() == torch::kBFloat16 || h.scalar_type() == torch::kFloat),
              "h must be a contiguous bf16 or fp32 CPU tensor [T, D] with 1 <= T <= 16");
  TORCH_CHECK(out.sizes() == h.sizes() && out.is_contiguous() && out.scalar_type() == h.scalar_type(),
              "out must be contiguous [T, D] of h's dtype (the experts' output dim must equal D)");
  const int64_t T = h.size(0), D = h.size(1);
  auto x = torch::empty_like(h);
  rms_norm_out(h, norm_w, norm_eps, norm_weight_fp32, x);
  auto ids = torch::empty({T, top_k}, h.options().dtype(torch::kLong));
  auto weights = torch::empty({T, top_k}, h.options().dtype(torch::kFloat));
  route_decode_out(x, gate_w, gate_bias, sel_bias, kind, renormalize, scale, n_group, topk_group, ids, weights);
  auto y = torch::empty_like(h);
  const int64_t max_load = moe_glu_decode_out(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, act, alpha, limit,
                                              y, load);
  if (h.scalar_type() == torch::kBFloat16)
    add_rows(h.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), T * D, out.data_ptr<c10::BFloat16>());
  else
    add_rows(h.data_ptr<float>(), y.data_ptr<float>(), T * D, out.data_ptr<float>());
  return max_load;
}
