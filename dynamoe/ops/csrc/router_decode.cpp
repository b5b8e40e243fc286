// A decode step's router in one call (CPU, T <= 16 tokens): fp32 logits x W^T (+ bias) from bf16 or fp32
// x and W, then the gating policy of dynamoe.ops.routing, writing ids [T, K] int64 and weights [T, K]
// fp32 -- what the MoE layer's general path computes with ~10 small torch ops (and a conversion of the
// whole router weight to fp32 on every call).
//
// kind 0, softmax_topk: the K largest logits; weights = softmax over those K (renormalize) or the full
//   softmax's probabilities at them; times scale.
// kind 1, sigmoid_group_topk (DeepSeek-V3): scores = sigmoid(logits), choice = scores + sel_bias; with
//   n_group > 1 and topk_group < n_group only the topk_group groups with the largest sum of their two
//   best choices (their max without a bias) stay eligible; the K best choices are weighted by their
//   scores, renormalized (sum + 1e-20) if asked, times scale.
// Ties go to the lower expert id. Registered in packed_gemv.cpp's module.
#include <torch/extension.h>
#include "decode_ops.h"
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include "decode_rows.h"

namespace {
using dynamoe::dot_f32;

template <typename scalar_t>
void logits_rows(const torch::Tensor& x, const torch::Tensor& w, const float* bias, float* logits) {
  const int64_t T = x.size(0), D = x.size(1), E = w.size(0);
  std::vector<float> xf(D);
  const scalar_t* wp = w.data_ptr<scalar_t>();
  for (int64_t t = 0; t < T; ++t) {
    if (x.scalar_type() == torch::kBFloat16) {
      const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>() + t * D;
      for (int64_t i = 0; i < D; ++i) xf[i] = static_cast<float>(xp[i]);
    } else {
      const float* xp = x.data_ptr<float>() + t * D;
      std::copy(xp, xp + D, xf.begin());
    }
    for (int64_t e = 0; e < E; ++e) logits[t * E + e] = dot_f32(xf.data(), wp + e * D, D) + (bias ? bias[e] : 0.f);
  }
}

// indices of the K largest v[0..n) (ties: lower index first), in decreasing order
void top_indices(const float* v, int64_t n, int64_t K, int64_t* out) {
  std::vector<int64_t> idx(n);
  for (int64_t i = 0; i < n; ++i) idx[i] = i;
  auto better = [v](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + K, idx.end(), better);
  std::copy(idx.begin(), idx.begin() + K, out);
}
}  // namespace

void route_decode_out(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                      c10::optional<torch::Tensor> sel_bias, int64_t kind, bool renormalize, double scale,
                      int64_t n_group, int64_t topk_group, torch::Tensor ids, torch::Tensor weights) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat),
              "x must be contiguous bf16 or fp32 [T, D]");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1) &&
              (w.scalar_type() == torch::kBFloat16 || w.scalar_type() == torch::kFloat),
              "w must be contiguous bf16 or fp32 [E, ", x.size(1), "]");
  const int64_t T = x.size(0), E = w.size(0);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == torch::kLong && ids.is_contiguous(),
              "ids must be contiguous int64 [T, K]");
  const int64_t K = ids.size(1);
  TORCH_CHECK(K >= 1 && K <= E, "K must be in [1, ", E, "], got ", K);
  TORCH_CHECK(weights.dim() == 2 && weights.size(0) == T && weights.size(1) == K &&
              weights.scalar_type() == torch::kFloat && weights.is_contiguous(), "weights must be contiguous fp32 [T, K]");
  TORCH_CHECK(kind == dynamoe::kSoftmaxTopK || kind == dynamoe::kSigmoidGroupTopK,
              "kind must be RouterKind.softmax (0) or RouterKind.sigmoid (1), got ", kind);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == E && bias->scalar_type() == torch::kFloat && bias->is_contiguous(),
                "bias must be contiguous fp32 [E]");
    bp = bias->data_ptr<float>();
  }
  const float* sb = nullptr;
  if (sel_bias.has_value()) {
    TORCH_CHECK(sel_bias->dim() == 1 && sel_bias->size(0) == E && sel_bias->scalar_type() == torch::kFloat &&
                sel_bias->is_contiguous(), "sel_bias must be contiguous fp32 [E]");
    sb = sel_bias->data_ptr<float>();
  }
  const bool grouped = kind == dynamoe::kSigmoidGroupTopK && n_group > 1 && topk_group < n_group;
  if (grouped)
    TORCH_CHECK(E % n_group == 0 && topk_group >= 1 && topk_group * (E / n_group) >= K,
                "n_group must divide E and topk_group groups must hold K experts");

  std::vector<float> logits(T * E);
  if (w.scalar_type() == torch::kBFloat16)
    logits_rows<c10::BFloat16>(x, w, bp, logits.data());
  else
    logits_rows<float>(x, w, bp, logits.data());

  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  const float fs = static_cast<float>(scale);
  std::vector<float> scores(E), choice(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = logits.data() + t * E;
    int64_t* it = ip + t * K;
    float* wt = wp + t * K;
    if (kind == dynamoe::kSoftmaxTopK) {
      top_indices(l, E, K, it);
      const float mx = l[it[0]];
      float denom = 0.f;
      if (renormalize) {
        for (int64_t j = 0; j < K; ++j) denom += std::exp(l[it[j]] - mx);
      } else {
        float full_max = l[0];
        for (int64_t e = 1; e < E; ++e) full_max = std::max(full_max, l[e]);
        for (int64_t e = 0; e < E; ++e) denom += std::exp(l[e] - full_max);
        for (int64_t j = 0; j < K; ++j) wt[j] = std::exp(l[it[j]] - full_max) / denom * fs;
        continue;
      }
      for (int64_t j = 0; j < K; ++j) wt[j] = std::exp(l[it[j]] - mx) / denom * fs;
    } else {
      for (int64_t e = 0; e < E; ++e) {
        scores[e] = 1.f / (1.f + std::exp(-l[e]));
        choice[e] = scores[e] + (sb ? sb[e] : 0.f);
      }
      if (grouped) {
        const int64_t per = E / n_group;
        std::vector<float> gscore(n_group);
        for (int64_t g = 0; g < n_group; ++g) {
          const float* c = choice.data() + g * per;
          if (sb && per >= 2) {
            int64_t top2[2];
            top_indices(c, per, 2, top2);
            gscore[g] = c[top2[0]] + c[top2[1]];
          } else {
            gscore[g] = *std::max_element(c, c + per);
          }
        }
        std::vector<int64_t> keep(topk_group);
        top_indices(gscore.data(), n_group, topk_group, keep.data());
        std::vector<char> kept(n_group, 0);
        for (int64_t g : keep) kept[g] = 1;
        for (int64_t e = 0; e < E; ++e)
          if (!kept[e / per]) choice[e] = -std::numeric_limits<float>::infinity();
      }
      top_indices(choice.data(), E, K, it);
      float sum = 0.f;
      for (int64_t j = 0; j < K; ++j) sum += scores[it[j]];
      const float denom = renormalize ? sum + 1e-20f : 1.f;
      for (int64_t j = 0; j < K; ++j) wt[j] = scores[it[j]] / denom * fs;
    }
  }
}
