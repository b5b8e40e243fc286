// A decode step's routed GLU experts in one call (bf16 or fp32 weights, CPU): for T <= 16 tokens with K experts
// each, out[t] = sum_k w[t, k] * down[e](act(gate[e] x_t, up[e] x_t)) with e = ids[t, k].
//
// Every expert chosen by some token is one group (its weight rows are read once for all its tokens):
// phase 1 runs gate_up over all groups in one parallel region, the activation is applied to the
// [pairs, 2F] result, phase 2 runs down over all groups, and the weighted sum per token is taken in
// fp32. Besides the output, it fills load[E] (assignments per expert) and returns the largest load,
// which are the routing statistics the MoE layer reports. Registered in packed_gemv.cpp's module.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <vector>
#include "gemv_blocks.h"

namespace {
enum Act : int64_t { kSilu = 0, kGelu = 1, kGeluTanh = 2, kRelu = 3, kGptOss = 4 };

inline float act_gate(float g, int64_t kind, float alpha, float limit) {
  switch (kind) {
    case kSilu: return g / (1.f + std::exp(-g));
    case kGelu: return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f));
    case kGeluTanh: {
      const float c = 0.79788456080286536f;  // sqrt(2 / pi)
      return 0.5f * g * (1.f + std::tanh(c * (g + 0.044715f * g * g * g)));
    }
    case kRelu: return g > 0.f ? g : 0.f;
    default: {  // gpt_oss: gate clamped above at limit, then gate * sigmoid(alpha * gate)
      const float c = std::min(g, limit);
      return c / (1.f + std::exp(-alpha * c));
    }
  }
}

// one weight [E, O, I] over the groups' rows: g = (expert, first row, rows), x [pairs, I] -> out [pairs, O]
template <typename scalar_t>
void run_groups(const std::vector<int64_t>& groups, const scalar_t* w, int64_t O, int64_t I, const scalar_t* x,
                const scalar_t* bias, scalar_t* out) {
  const int64_t G = static_cast<int64_t>(groups.size()) / 3;
  const int64_t blocks = (O + dynamoe::kGemvRowBlock - 1) / dynamoe::kGemvRowBlock;
  at::parallel_for(0, G * blocks, dynamoe::grain_blocks(I, sizeof(scalar_t)), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / blocks, e = groups[3 * g], off = groups[3 * g + 1];
      dynamoe::row_block(w + e * O * I, O, I, (item % blocks) * dynamoe::kGemvRowBlock, x + off * I, I,
                         groups[3 * g + 2], bias ? bias + e * O : nullptr, out + off * O, O);
    }
  });
}

template <typename scalar_t>
const scalar_t* optional_bias(const c10::optional<torch::Tensor>& b, int64_t E, int64_t O, c10::ScalarType dtype,
                              const char* name) {
  if (!b.has_value()) return nullptr;
  TORCH_CHECK(b->dim() == 2 && b->size(0) == E && b->size(1) == O && b->scalar_type() == dtype &&
              b->is_contiguous(), name, " must be contiguous ", dtype, " [", E, ", ", O, "]");
  return b->data_ptr<scalar_t>();
}

template <typename scalar_t>
int64_t moe_glu_decode(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w_gate_up,
                       torch::Tensor w_down, c10::optional<torch::Tensor> b_gate_up,
                       c10::optional<torch::Tensor> b_down, int64_t act, double alpha, double limit,
                       torch::Tensor out, torch::Tensor load) {
  const c10::ScalarType dtype = w_gate_up.scalar_type();
  TORCH_CHECK(w_gate_up.dim() == 3 && w_gate_up.is_contiguous(), "w_gate_up must be contiguous [E, 2F, D]");
  TORCH_CHECK(w_down.dim() == 3 && w_down.scalar_type() == dtype && w_down.is_contiguous(),
              "w_down must be contiguous ", dtype, " [E, O, F]");
  const int64_t E = w_gate_up.size(0), F2 = w_gate_up.size(1), D = w_gate_up.size(2), F = F2 / 2;
  const int64_t O = w_down.size(1);
  TORCH_CHECK(F2 % 2 == 0 && w_down.size(0) == E && w_down.size(2) == F, "w_down must be [", E, ", O, ", F, "]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && x.is_contiguous() && x.size(1) == D,
              "x must be contiguous ", dtype, " [T, ", D, "]");
  const int64_t T = x.size(0);
  TORCH_CHECK(T >= 1 && T <= 16, "x must have 1..16 rows, got ", T);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == torch::kLong && ids.is_contiguous(),
              "ids must be contiguous int64 [T, K]");
  const int64_t K = ids.size(1);
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == T && weights.size(1) == K &&
              weights.scalar_type() == torch::kFloat && weights.is_contiguous(), "weights must be contiguous fp32 [T, K]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == O && out.scalar_type() == dtype &&
              out.is_contiguous(), "out must be contiguous ", dtype, " [T, ", O, "]");
  TORCH_CHECK(load.dim() == 1 && load.size(0) == E && load.scalar_type() == torch::kLong && load.is_contiguous(),
              "load must be contiguous int64 [", E, "]");
  TORCH_CHECK(act >= kSilu && act <= kGptOss, "act must be 0..4 (silu, gelu, gelu_tanh, relu, gpt_oss), got ", act);
  const scalar_t* bgu = optional_bias<scalar_t>(b_gate_up, E, F2, dtype, "b_gate_up");
  const scalar_t* bd = optional_bias<scalar_t>(b_down, E, O, dtype, "b_down");

  // groups: experts in order of first use; pairs sorted by group; pair p = (token, weight)
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();
  int64_t* lp = load.data_ptr<int64_t>();
  std::fill(lp, lp + E, int64_t{0});
  std::vector<int64_t> order;  // distinct experts, first use order
  order.reserve(T * K);
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t e = ip[i];
    TORCH_CHECK(e >= 0 && e < E, "expert id ", e, " out of range [0, ", E, ")");
    if (lp[e]++ == 0) order.push_back(e);
  }
  std::vector<int64_t> groups, pair_token(T * K), first(E);
  std::vector<float> pair_weight(T * K);
  int64_t off = 0, max_load = 0;
  for (int64_t e : order) {
    groups.insert(groups.end(), {e, off, lp[e]});
    first[e] = off;
    off += lp[e];
    max_load = std::max(max_load, lp[e]);
  }
  std::vector<int64_t> fill(E, 0);
  auto xg = torch::empty({T * K, D}, x.options());
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* xgp = xg.data_ptr<scalar_t>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = ip[t * K + k], p = first[e] + fill[e]++;
      pair_token[p] = t;
      pair_weight[p] = wp[t * K + k];
      std::copy(xp + t * D, xp + (t + 1) * D, xgp + p * D);
    }

  auto gu = torch::empty({T * K, F2}, x.options());
  run_groups<scalar_t>(groups, w_gate_up.data_ptr<scalar_t>(), F2, D, xgp, bgu, gu.data_ptr<scalar_t>());
  auto h = torch::empty({T * K, F}, x.options());
  scalar_t* gup = gu.data_ptr<scalar_t>();
  scalar_t* hp = h.data_ptr<scalar_t>();
  const float a = static_cast<float>(alpha), lim = static_cast<float>(limit);
  for (int64_t p = 0; p < T * K; ++p)
    for (int64_t f = 0; f < F; ++f) {
      const float g = static_cast<float>(gup[p * F2 + f]);
      float u = static_cast<float>(gup[p * F2 + F + f]);
      if (act == kGptOss) u = std::min(std::max(u, -lim), lim) + 1.f;
      hp[p * F + f] = static_cast<scalar_t>(act_gate(g, act, a, lim) * u);
    }
  auto y = torch::empty({T * K, O}, x.options());
  run_groups<scalar_t>(groups, w_down.data_ptr<scalar_t>(), O, F, hp, bd, y.data_ptr<scalar_t>());

  std::vector<float> acc(T * O, 0.f);
  const scalar_t* yp = y.data_ptr<scalar_t>();
  for (int64_t p = 0; p < T * K; ++p) {
    float* row = acc.data() + pair_token[p] * O;
    const float w = pair_weight[p];
    for (int64_t o = 0; o < O; ++o) row[o] += w * static_cast<float>(yp[p * O + o]);
  }
  scalar_t* op = out.data_ptr<scalar_t>();
  for (int64_t i = 0; i < T * O; ++i) op[i] = static_cast<scalar_t>(acc[i]);
  return max_load;
}
}  // namespace

int64_t moe_glu_decode_out(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w_gate_up,
                           torch::Tensor w_down, c10::optional<torch::Tensor> b_gate_up,
                           c10::optional<torch::Tensor> b_down, int64_t act, double alpha, double limit,
                           torch::Tensor out, torch::Tensor load) {
  switch (w_gate_up.scalar_type()) {
    case torch::kBFloat16:
      return moe_glu_decode<c10::BFloat16>(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, act, alpha, limit, out, load);
    case torch::kFloat:
      return moe_glu_decode<float>(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, act, alpha, limit, out, load);
    default:
      TORCH_CHECK(false, "w_gate_up must be bf16 or fp32, got ", w_gate_up.scalar_type());
  }
}
