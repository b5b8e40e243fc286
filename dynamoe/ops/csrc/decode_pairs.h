// A decode step's (token, expert) pairs grouped by expert, shared by the fused decode kernels
// (moe_decode.cpp, moe_decode_packed.cpp): each expert's weights are then read once for all its tokens.
#pragma once
#include "decode_weights.h"
#include <torch/extension.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace dynamoe {
constexpr int64_t kDecodeMaxTokens = kMaxRows;  // (decode_weights.h)

struct DecodePairs {
  std::vector<int64_t> groups;       // (expert, first pair, pairs) per chosen expert, in order of first use
  std::vector<int64_t> pair_token;   // pairs sorted by group: the token of each
  std::vector<float> pair_weight;    // and its combine weight
  int64_t max_load = 0;
};

// Checks ids [T, K] int64, weights [T, K] fp32 and load [E] int64 (filled with each expert's pairs);
// x rows are T (1..kDecodeMaxTokens).
inline DecodePairs group_pairs(const torch::Tensor& ids, const torch::Tensor& weights, int64_t T, int64_t E,
                               torch::Tensor& load) {
  TORCH_CHECK(T >= 1 && T <= kDecodeMaxTokens, "x must have 1..", kDecodeMaxTokens, " rows, got ", T);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == torch::kLong && ids.is_contiguous(),
              "ids must be contiguous int64 [T, K]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == torch::kFloat && weights.is_contiguous(),
              "weights must be contiguous fp32 [T, K]");
  TORCH_CHECK(load.dim() == 1 && load.size(0) == E && load.scalar_type() == torch::kLong && load.is_contiguous(),
              "load must be contiguous int64 [", E, "]");
  const int64_t K = ids.size(1), P = T * K;
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* wp = weights.data_ptr<float>();
  int64_t* lp = load.data_ptr<int64_t>();
  std::fill(lp, lp + E, int64_t{0});
  std::vector<int64_t> order;
  order.reserve(P);
  for (int64_t i = 0; i < P; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < E, "expert id ", ip[i], " out of range [0, ", E, ")");
    if (lp[ip[i]]++ == 0) order.push_back(ip[i]);
  }
  DecodePairs d;
  d.pair_token.resize(P);
  d.pair_weight.resize(P);
  std::vector<int64_t> first(E), fill(E, 0);
  int64_t off = 0;
  for (int64_t e : order) {
    d.groups.insert(d.groups.end(), {e, off, lp[e]});
    first[e] = off;
    off += lp[e];
    d.max_load = std::max(d.max_load, lp[e]);
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = ip[t * K + k], p = first[e] + fill[e]++;
      d.pair_token[p] = t;
      d.pair_weight[p] = wp[t * K + k];
    }
  return d;
}

// xg [pairs, D] = x [T, D] rows in pair order
template <typename scalar_t>
void gather_pairs(const DecodePairs& d, const scalar_t* x, int64_t D, scalar_t* xg) {
  for (size_t p = 0; p < d.pair_token.size(); ++p)
    std::copy(x + d.pair_token[p] * D, x + (d.pair_token[p] + 1) * D, xg + p * D);
}

// out [T, O] = sum over each token's pairs of weight * y [pairs, O], in fp32, rounded once
template <typename y_t, typename out_t>
void combine_pairs(const DecodePairs& d, const y_t* y, int64_t T, int64_t O, out_t* out) {
  std::vector<float> acc(T * O, 0.f);
  for (size_t p = 0; p < d.pair_token.size(); ++p) {
    float* row = acc.data() + d.pair_token[p] * O;
    const float w = d.pair_weight[p];
    for (int64_t o = 0; o < O; ++o) row[o] += w * static_cast<float>(y[p * O + o]);
  }
  for (int64_t i = 0; i < T * O; ++i) out[i] = static_cast<out_t>(acc[i]);
}

// the expert activations (decode_weights.h's Activation): the gate part of a GLU, or an FFN's
inline float act_gate(float g, int64_t kind, float alpha, float limit) {
  switch (kind) {
    case kSilu: return g / (1.f + std::exp(-g));
    case kGelu: return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f));
    case kGeluTanh: return 0.5f * g * (1.f + std::tanh(0.79788456080286536f * (g + 0.044715f * g * g * g)));
    case kRelu: return g > 0.f ? g : 0.f;
    case kReluSquared: return g > 0.f ? g * g : 0.f;
    case kSiluClamp: return std::min(g / (1.f + std::exp(-g)), limit);
    case kSiluClampIn: {
      const float c = std::min(g, limit);
      return c / (1.f + std::exp(-c));
    }
    default: {  // gpt_oss: gate clamped above at limit, then gate * sigmoid(alpha * gate)
      const float c = std::min(g, limit);
      return c / (1.f + std::exp(-alpha * c));
    }
  }
}

// one GLU output: act(gate) * up (gpt_oss: up clamped to +-limit, plus one; silu_clamp(_in): up clamped to +-limit)
inline float glu_value(float g, float u, int64_t kind, float alpha, float limit) {
  if (kind == kGptOss) u = std::min(std::max(u, -limit), limit) + 1.f;
  if (kind == kSiluClamp || kind == kSiluClampIn) u = std::min(std::max(u, -limit), limit);
  return act_gate(g, kind, alpha, limit) * u;
}
}  // namespace dynamoe
