// A decode step's routed experts in one call (bf16 or fp32 weights, CPU): for T <= 16 tokens with K
// experts each, out[t] = sum_k w[t, k] * expert_e(x_t) with e = ids[t, k].
//
// Every expert chosen by some token is one group (decode_pairs.h: its weight rows are read once for all
// its tokens). GLU experts (gate_up [E, 2F, D], down [E, O, F]): gate_up over all groups in one
// parallel region, the activation in fp32, down in a second region. FFN experts in Tutel's layout (fc1
// [E, F, D], fc2 [E, F, O]): fc1 likewise, fc2 as row-scaled sums of its [F, O] rows over column blocks.
// The weighted sum per token is taken in fp32. Besides the output, load[E] gets the assignments per
// expert and the largest load is returned: the routing statistics the MoE layer reports.
// Registered in packed_gemv.cpp's module.
#include <torch/extension.h>
#include "decode_ops.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include <vector>
#include "decode_pairs.h"
#include "gemv_blocks.h"

namespace {
using dynamoe::DecodePairs;

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

// y [pairs, O] (fp32) = h [pairs, F] @ w[e] [F, O] (+ bias[e]) per group: each w row scaled by h and
// summed, over blocks of output columns (one parallel region for all groups)
template <typename scalar_t>
void run_groups_rows(const std::vector<int64_t>& groups, const scalar_t* w, int64_t F, int64_t O, const scalar_t* h,
                     const scalar_t* bias, float* y) {
  constexpr int64_t kCols = 256;
  const int64_t G = static_cast<int64_t>(groups.size()) / 3, cblocks = (O + kCols - 1) / kCols;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 20) / (F * kCols * static_cast<int64_t>(sizeof(scalar_t))));
  at::parallel_for(0, G * cblocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / cblocks, e = groups[3 * g], off = groups[3 * g + 1], n = groups[3 * g + 2];
      const int64_t c0 = (item % cblocks) * kCols, c1 = std::min(O, c0 + kCols);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t c = c0; c < c1; ++c) y[(off + t) * O + c] = bias ? static_cast<float>(bias[e * O + c]) : 0.f;
      const scalar_t* we = w + e * F * O;
      for (int64_t f = 0; f < F; ++f) {
        const scalar_t* wr = we + f * O;
        for (int64_t t = 0; t < n; ++t) {
          const float hv = static_cast<float>(h[(off + t) * F + f]);
          if (hv == 0.f) continue;  // ReLU zeros: nothing to add
          float* yr = y + (off + t) * O;
          for (int64_t c = c0; c < c1; ++c) yr[c] += hv * static_cast<float>(wr[c]);
        }
      }
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

void check_x_out(const torch::Tensor& x, const torch::Tensor& out, c10::ScalarType dtype, int64_t D, int64_t O) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && x.is_contiguous() && x.size(1) == D,
              "x must be contiguous ", dtype, " [T, ", D, "]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == O && out.scalar_type() == dtype &&
              out.is_contiguous(), "out must be contiguous ", dtype, " [T, ", O, "]");
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
  check_x_out(x, out, dtype, D, O);
  TORCH_CHECK(act >= 0 && act <= dynamoe::kSiluClampIn,
              "act must be a GLU activation 0..6 (silu, gelu, gelu_tanh, relu, gpt_oss, silu_clamp, silu_clamp_in), got ",
              act);
  const scalar_t* bgu = optional_bias<scalar_t>(b_gate_up, E, F2, dtype, "b_gate_up");
  const scalar_t* bd = optional_bias<scalar_t>(b_down, E, O, dtype, "b_down");
  const int64_t T = x.size(0);
  const DecodePairs d = dynamoe::group_pairs(ids, weights, T, E, load);
  const int64_t P = static_cast<int64_t>(d.pair_token.size());

  auto xg = torch::empty({P, D}, x.options());
  dynamoe::gather_pairs(d, x.data_ptr<scalar_t>(), D, xg.data_ptr<scalar_t>());
  auto gu = torch::empty({P, F2}, x.options());
  run_groups<scalar_t>(d.groups, w_gate_up.data_ptr<scalar_t>(), F2, D, xg.data_ptr<scalar_t>(), bgu, gu.data_ptr<scalar_t>());
  auto h = torch::empty({P, F}, x.options());
  const scalar_t* gup = gu.data_ptr<scalar_t>();
  scalar_t* hp = h.data_ptr<scalar_t>();
  const float a = static_cast<float>(alpha), lim = static_cast<float>(limit);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t f = 0; f < F; ++f) {
      hp[p * F + f] = static_cast<scalar_t>(dynamoe::glu_value(static_cast<float>(gup[p * F2 + f]),
                                                               static_cast<float>(gup[p * F2 + F + f]), act, a, lim));
    }
  auto y = torch::empty({P, O}, x.options());
  run_groups<scalar_t>(d.groups, w_down.data_ptr<scalar_t>(), O, F, hp, bd, y.data_ptr<scalar_t>());
  dynamoe::combine_pairs(d, y.data_ptr<scalar_t>(), T, O, out.data_ptr<scalar_t>());
  return d.max_load;
}

template <typename scalar_t>
int64_t moe_ffn_decode(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w1, torch::Tensor w2,
                       c10::optional<torch::Tensor> b1, c10::optional<torch::Tensor> b2, int64_t act,
                       torch::Tensor out, torch::Tensor load) {
  const c10::ScalarType dtype = w1.scalar_type();
  TORCH_CHECK(w1.dim() == 3 && w1.is_contiguous(), "w1 must be contiguous [E, F, D]");
  const int64_t E = w1.size(0), F = w1.size(1), D = w1.size(2);
  TORCH_CHECK(w2.dim() == 3 && w2.scalar_type() == dtype && w2.is_contiguous() && w2.size(0) == E && w2.size(1) == F,
              "w2 must be contiguous ", dtype, " [", E, ", ", F, ", O]");
  const int64_t O = w2.size(2);
  check_x_out(x, out, dtype, D, O);
  TORCH_CHECK(act == dynamoe::kSilu || act == dynamoe::kGelu || act == dynamoe::kRelu || act == dynamoe::kReluSquared,
              "act must be Activation.silu, gelu, relu or relu2 for FFN experts, got ", act);
  const scalar_t* bp1 = optional_bias<scalar_t>(b1, E, F, dtype, "b1");
  const scalar_t* bp2 = optional_bias<scalar_t>(b2, E, O, dtype, "b2");
  const int64_t T = x.size(0);
  const DecodePairs d = dynamoe::group_pairs(ids, weights, T, E, load);
  const int64_t P = static_cast<int64_t>(d.pair_token.size());

  auto xg = torch::empty({P, D}, x.options());
  dynamoe::gather_pairs(d, x.data_ptr<scalar_t>(), D, xg.data_ptr<scalar_t>());
  auto h = torch::empty({P, F}, x.options());
  scalar_t* hp = h.data_ptr<scalar_t>();
  run_groups<scalar_t>(d.groups, w1.data_ptr<scalar_t>(), F, D, xg.data_ptr<scalar_t>(), bp1, hp);
  for (int64_t i = 0; i < P * F; ++i) hp[i] = static_cast<scalar_t>(dynamoe::act_gate(static_cast<float>(hp[i]), act, 0.f, 0.f));
  std::vector<float> y(P * O);
  run_groups_rows<scalar_t>(d.groups, w2.data_ptr<scalar_t>(), F, O, hp, bp2, y.data());
  dynamoe::combine_pairs(d, y.data(), T, O, out.data_ptr<scalar_t>());
  return d.max_load;
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

int64_t moe_ffn_decode_out(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w1, torch::Tensor w2,
                           c10::optional<torch::Tensor> b1, c10::optional<torch::Tensor> b2, int64_t act,
                           torch::Tensor out, torch::Tensor load) {
  switch (w1.scalar_type()) {
    case torch::kBFloat16:
      return moe_ffn_decode<c10::BFloat16>(x, ids, weights, w1, w2, b1, b2, act, out, load);
    case torch::kFloat:
      return moe_ffn_decode<float>(x, ids, weights, w1, w2, b1, b2, act, out, load);
    default:
      TORCH_CHECK(false, "w1 must be bf16 or fp32, got ", w1.scalar_type());
  }
}
