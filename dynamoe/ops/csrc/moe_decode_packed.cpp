// A decode step's routed GLU experts with packed weights (blockwise FP8, MXFP4, NVFP4) in one call, as
// moe_decode.cpp does for bf16/fp32: tokens grouped by expert (each expert's packed bytes read once for
// all its tokens), gate_up rows in one parallel region, the activation in fp32, down rows in a second
// region, the weighted sum per token in fp32. x, biases and out are fp32 (the packed row kernels of
// packed_rows.h take fp32 activations). Fills load[E] and returns the largest load.
//
// A packed weight [E, O, I] is three tensors and two ints, by format:
//   0 FP8:   a = e4m3 bytes [E, O, I], b = fp32 scales [E, ceil(O/blk0), ceil(I/blk1)]
//   1 MXFP4: a = blocks [E, O, I/32, 16], b = e8m0 scales [E, O, I/32]
//   2 NVFP4: a = packed [E, O, I/2], b = e4m3 scales [E, O, I/16], c = fp32 global scales [E]
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include "decode_pairs.h"
#include "packed_rows.h"
#include "token_chunks.h"

namespace {
using namespace dynamoe::packed;
constexpr int64_t kRowsPerItem = 16;
constexpr int64_t kAhead = 4;  // rows prefetched ahead

struct Packed {
  int64_t fmt, E, O, I, blk0 = 1, blk1 = 1;
  const uint8_t* a;
  const uint8_t* b8 = nullptr;     // MXFP4 / NVFP4 scales
  const float* bf = nullptr;       // FP8 scales
  const float* global = nullptr;   // NVFP4
};

Packed packed_weight(int64_t fmt, const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c, int64_t blk0,
                     int64_t blk1, const char* name) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.element_size() == 1, name, ": packed tensors must be contiguous bytes");
  Packed w{fmt, a.size(0), a.size(1), 0};
  w.a = static_cast<const uint8_t*>(a.data_ptr());
  if (fmt == 0) {
    TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && b.scalar_type() == torch::kFloat && blk0 >= 1 && blk1 >= 1, name,
                ": FP8 needs bytes [E, O, I] and fp32 scales [E, R, C]");
    w.I = a.size(2);
    w.blk0 = blk0;
    w.blk1 = blk1;
    TORCH_CHECK(b.size(0) == w.E && b.size(1) == (w.O + blk0 - 1) / blk0 && b.size(2) == (w.I + blk1 - 1) / blk1, name,
                ": FP8 scales must be [E, ceil(O/", blk0, "), ceil(I/", blk1, ")]");
    w.bf = b.data_ptr<float>();
  } else if (fmt == 1) {
    TORCH_CHECK(a.dim() == 4 && a.size(3) == 16 && b.dim() == 3 && b.size(0) == w.E && b.size(1) == w.O &&
                b.size(2) == a.size(2) && b.element_size() == 1, name, ": MXFP4 needs blocks [E, O, I/32, 16], scales [E, O, I/32]");
    w.I = a.size(2) * 32;
    w.b8 = static_cast<const uint8_t*>(b.data_ptr());
  } else {
    TORCH_CHECK(fmt == 2 && a.dim() == 3 && b.dim() == 3 && b.element_size() == 1 && b.size(0) == w.E && b.size(1) == w.O,
                name, ": format must be 0 (FP8), 1 (MXFP4) or 2 (NVFP4); NVFP4 needs packed [E, O, I/2], scales [E, O, I/16]");
    w.I = a.size(2) * 2;
    TORCH_CHECK(w.I % 16 == 0 && b.size(2) == w.I / 16, name, ": NVFP4 scales must be [E, O, I/16]");
    TORCH_CHECK(c.numel() == w.E && c.scalar_type() == torch::kFloat && c.is_contiguous(), name,
                ": NVFP4 needs fp32 global scales [E]");
    w.b8 = static_cast<const uint8_t*>(b.data_ptr());
    w.global = c.data_ptr<float>();
  }
  return w;
}

// rows [o0, o1) of expert e for Tg tokens: x [Tg, I] (FP8) or its even/odd halves xe, xo [Tg, I/2] (FP4)
void rows(const Packed& w, int64_t e, int64_t o0, int64_t o1, const float* x, const float* xe, const float* xo,
          int64_t Tg, float* out, int64_t out_stride, const float* lut_fp8, const float* e8m0, const float* e4m3_raw) {
  const int64_t I = w.I, h = I / 2;
  if (w.fmt == 0) {
    const int64_t C = (I + w.blk1 - 1) / w.blk1, R = (w.O + w.blk0 - 1) / w.blk0;
    const uint8_t* q = w.a + e * w.O * I;
    const float* s = w.bf + e * R * C;
    for (int64_t o = o0; o < o1; ++o) {
#if defined(__AVX512F__)
      if (o + kAhead < w.O)
        for (int64_t c = 0; c < I; c += 64) _mm_prefetch(reinterpret_cast<const char*>(q + (o + kAhead) * I + c), _MM_HINT_T0);
#endif
      dynamoe::for_token_chunks(Tg, [&]<int TT>(int64_t t0) {
        fp8_row<TT>(q + o * I, I, x + t0 * I, s + (o / w.blk0) * C, w.blk1, lut_fp8, out + t0 * out_stride + o, out_stride);
      });
    }
    return;
  }
  const int64_t G = w.fmt == 1 ? I / 32 : I / 16;
  std::vector<float> gs(G);
  float e4m3[256];
  if (w.fmt == 2)
    for (int v = 0; v < 256; ++v) e4m3[v] = e4m3_raw[v] * w.global[e];
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* srow = w.b8 + (e * w.O + o) * G;
    const uint8_t* prow = w.a + (e * w.O + o) * h;
#if defined(__AVX512F__)
    // the packed bytes of a row ahead: decoding is too short per byte for the hardware prefetcher
    // to hide the memory latency of weights that are not in cache
    if (o + kAhead < w.O)
      for (int64_t c = 0; c < h; c += 64) _mm_prefetch(reinterpret_cast<const char*>(prow + kAhead * h + c), _MM_HINT_T0);
#endif
    if (w.fmt == 1) {
      for (int64_t g = 0; g < G; ++g) gs[g] = e8m0[srow[g]];
      dynamoe::for_token_chunks(Tg, [&]<int TT>(int64_t t0) {
        fp4_row<TT, 16>(prow, h, xe + t0 * h, xo + t0 * h, h, gs.data(), out + t0 * out_stride + o, out_stride);
      });
    } else {
      nvfp4_row_scales(srow, G, w.global[e], e4m3, gs.data());
      dynamoe::for_token_chunks(Tg, [&]<int TT>(int64_t t0) {
        fp4_row<TT, 8>(prow, h, xe + t0 * h, xo + t0 * h, h, gs.data(), out + t0 * out_stride + o, out_stride);
      });
    }
  }
}

// one weight over all groups: x [pairs, I] (and its halves) -> out [pairs, O], one parallel region
void run(const Packed& w, const std::vector<int64_t>& groups, const std::vector<float>& x, const std::vector<float>& xe,
         const std::vector<float>& xo, const float* bias, float* out, const float* lut, const float* e8m0,
         const float* e4m3_raw) {
  const int64_t G = static_cast<int64_t>(groups.size()) / 3, O = w.O, I = w.I;
  const int64_t chunks = (O + kRowsPerItem - 1) / kRowsPerItem;
  at::parallel_for(0, G * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / chunks, e = groups[3 * g], off = groups[3 * g + 1], n = groups[3 * g + 2];
      const int64_t o0 = (item % chunks) * kRowsPerItem, o1 = std::min(O, o0 + kRowsPerItem);
      rows(w, e, o0, o1, x.data() + off * I, xe.empty() ? nullptr : xe.data() + off * (I / 2),
           xo.empty() ? nullptr : xo.data() + off * (I / 2), n, out + off * O, O, lut, e8m0, e4m3_raw);
      if (bias)
        for (int64_t t = 0; t < n; ++t)
          for (int64_t o = o0; o < o1; ++o) out[(off + t) * O + o] += bias[e * O + o];
    }
  });
}
}  // namespace

int64_t packed_moe_glu_decode_out(int64_t fmt, torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                                  torch::Tensor w1a, torch::Tensor w1b, torch::Tensor w1c, torch::Tensor w2a,
                                  torch::Tensor w2b, torch::Tensor w2c, int64_t blk0, int64_t blk1,
                                  c10::optional<torch::Tensor> b1, c10::optional<torch::Tensor> b2, int64_t act,
                                  double alpha, double limit, torch::Tensor out, torch::Tensor load) {
  const Packed w1 = packed_weight(fmt, w1a, w1b, w1c, blk0, blk1, "w1");
  const Packed w2 = packed_weight(fmt, w2a, w2b, w2c, blk0, blk1, "w2");
  const int64_t E = w1.E, F2 = w1.O, F = F2 / 2, D = w1.I, O = w2.O;
  TORCH_CHECK(F2 % 2 == 0 && w2.E == E && w2.I == F, "w2 must be [", E, ", O, ", F, "] for w1 [", E, ", ", F2, ", ", D, "]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) == D,
              "x must be contiguous fp32 [T, ", D, "]");
  TORCH_CHECK(act >= 0 && act <= 4, "act must be 0..4 (silu, gelu, gelu_tanh, relu, gpt_oss), got ", act);
  const float* bp1 = nullptr;
  const float* bp2 = nullptr;
  if (b1.has_value()) {
    TORCH_CHECK(b1->dim() == 2 && b1->size(0) == E && b1->size(1) == F2 && b1->scalar_type() == torch::kFloat &&
                b1->is_contiguous(), "b1 must be contiguous fp32 [E, 2F]");
    bp1 = b1->data_ptr<float>();
  }
  if (b2.has_value()) {
    TORCH_CHECK(b2->dim() == 2 && b2->size(0) == E && b2->size(1) == O && b2->scalar_type() == torch::kFloat &&
                b2->is_contiguous(), "b2 must be contiguous fp32 [E, O]");
    bp2 = b2->data_ptr<float>();
  }

  const int64_t T = x.size(0);
  const dynamoe::DecodePairs d = dynamoe::group_pairs(ids, weights, T, E, load);
  const int64_t P = static_cast<int64_t>(d.pair_token.size());
  std::vector<float> xg(P * D);
  dynamoe::gather_pairs(d, x.data_ptr<float>(), D, xg.data());

  float lut[256], e8m0[256], e4m3_raw[256];
  for (int v = 0; v < 256; ++v) {
    lut[v] = e4m3_value(static_cast<uint8_t>(v));
    e8m0[v] = e8m0_value(static_cast<uint8_t>(v));
    e4m3_raw[v] = lut[v];
  }
  std::vector<float> xe, xo;
  if (fmt != 0) split_even_odd(xg.data(), P, D, xe, xo);
  std::vector<float> gu(P * F2);
  run(w1, d.groups, xg, xe, xo, bp1, gu.data(), lut, e8m0, e4m3_raw);

  std::vector<float> hbuf(P * F);
  const float a = static_cast<float>(alpha), lim = static_cast<float>(limit);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t f = 0; f < F; ++f) {
      hbuf[p * F + f] = dynamoe::glu_value(gu[p * F2 + f], gu[p * F2 + F + f], act, a, lim);
    }
  if (fmt != 0) split_even_odd(hbuf.data(), P, F, xe, xo);
  std::vector<float> y(P * O);
  run(w2, d.groups, hbuf, xe, xo, bp2, y.data(), lut, e8m0, e4m3_raw);

  dynamoe::combine_pairs(d, y.data(), T, O, out.data_ptr<float>());
  return d.max_load;
}
